#!/bin/bash
# Session 40, call 1 (carry .whl .scratch): prefetch GPU tests, router hidden step, layer parts
# with L2 prefetch variants, prefill tail sweep at block 128.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step tests 200 python3 -m pytest -q -x tests/gpu/test_prefetch_gpu.py tests/gpu/test_hopper_quantized.py
tail -3 $OUT/tests.txt
step router 90 env PYTHONPATH=$PWD/perf:$PYTHONPATH python3 perf/results/h200_2026-12-05_last_block_tail/router_h.py
grep "^T " $OUT/router.txt
step parts 300 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served no_prefetch prefetch_12mb prefetch_40mb --kernels served no_prefetch --out $OUT/parts.json
grep -B2 -A8 "read bandwidth" $OUT/parts.txt
step tail128 150 bash perf/results/h200_2026-12-05_last_block_tail/tail128.sh
cat $OUT/tail128.txt | tail -14
