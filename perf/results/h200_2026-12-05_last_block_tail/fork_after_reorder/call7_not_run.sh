#!/bin/bash
# Session 40, call 7 (carry .whl .scratch): the routed experts' reorder before the fork and their
# high-priority stream: layer parts against each change undone; quantized engine tests.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step parts 120 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served unprioritized reorder_in_branch --kernels served --out $OUT/parts.json
grep -E "^batch +[0-9]+ +[a-z_]+:" $OUT/parts.txt
grep -A20 "batch 1, served: one layer" $OUT/parts.txt | head -21
step tests 150 python3 -m pytest -q tests/gpu/test_hopper_quantized.py tests/unit/kernels/triton/test_nvfp4_moe_triton.py -k "quantized or reordered or hopper"
tail -2 $OUT/tests.txt
