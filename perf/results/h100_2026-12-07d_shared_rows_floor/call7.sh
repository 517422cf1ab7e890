#!/usr/bin/env bash
# Stop 56 call 7: the align kernels at CHUNK 64 on the GPU: the NVFP4 MoE GPU tests, then the
# MoE layer at batch 64 (served and serial; call 2 had served 951.0 µs at CHUNK 128).
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
. perf/device_env.sh
step tests 240 python3 -m pytest -q -x tests/gpu/test_nvfp4_moe_gpu.py
tail -3 "$OUT/tests.txt"
step parts 150 python3 perf/bench_moe_layer_parts.py --batches 64 --variants served serial \
  no_shared --kernels served --out "$OUT/parts.json"
grep -E "_count_kernel|_place_kernel|permute_k|gate_up_kernel" "$OUT/parts.txt"
grep -A6 "read bandwidth" "$OUT/parts.txt"
