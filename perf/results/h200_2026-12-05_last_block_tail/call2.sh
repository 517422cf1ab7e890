#!/bin/bash
# Session 40, call 2 (carry .whl .scratch): L2 prefetch probe, prefill tails past block 64,
# layer parts with the router's whole-row step, router GPU tests.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step l2probe 120 python3 perf/results/h200_2026-12-05_last_block_tail/l2probe.py
grep -E "cold|hot|MB" $OUT/l2probe.txt
step router_tests 120 python3 -m pytest -q tests/gpu/test_router_gpu.py
tail -1 $OUT/router_tests.txt
step parts 200 python3 perf/bench_moe_layer_parts.py --batches 1 8 \
  --variants served no_prefetch prefetch_40mb --kernels served --out $OUT/parts.json
grep -A7 "read bandwidth" $OUT/parts.txt
step tail2 240 env PYTHONPATH=$PWD/perf:$PYTHONPATH python3 perf/results/h200_2026-12-05_last_block_tail/tails.py call2
grep -E "dense|^E" $OUT/tail2.txt
