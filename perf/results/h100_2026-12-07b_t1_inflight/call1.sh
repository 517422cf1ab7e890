#!/usr/bin/env bash
# Stop 54 call 1: T 1's bytes-in-flight ablations first (the decision), then issue 10's layer
# table parts and the GPU tests at HEAD.
set -u
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step nvfp4_t1 240 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 --prefill 2048 --no-grouped \
  --ablations --ablation-tokens 1,8 --out "$OUT/nvfp4_t1.json" \
  --variants default,stages4,stages4_r128,rows64_k1,rows64_k1_s4,rows64_k1_s5,rows64_k1_s6
tail -30 "$OUT/nvfp4_t1.txt"
step parts 150 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 --kernels served \
  --out "$OUT/parts.json"
grep -A10 "read bandwidth" "$OUT/parts.txt"
step tests 200 python3 -m pytest -q tests/gpu/test_nvfp4_moe_gpu.py tests/gpu/test_hopper_quantized.py
tail -2 "$OUT/tests.txt"
return_triton_cache
(cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
