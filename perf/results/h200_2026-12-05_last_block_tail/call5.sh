#!/bin/bash
# Session 40, call 5 (carry .whl .scratch): issue 10's layer table at HEAD (the router's
# whole-row step, last-block tails): marginal parts and bench_moe_layer.py.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step parts 150 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served no_shared no_routed no_moe --kernels served --out $OUT/parts.json
grep -A8 "read bandwidth" $OUT/parts.txt
step moe_layer 200 python3 perf/bench_moe_layer.py --out $OUT/moe_layer.json
tail -8 $OUT/moe_layer.txt
