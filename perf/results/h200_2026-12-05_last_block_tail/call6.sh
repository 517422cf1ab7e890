#!/bin/bash
# Session 40, call 6 (carry .whl .scratch): the routed experts on a high-priority stream:
# layer parts (served vs unprioritized), quantized engine tests, the serving slice's C16/C64.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step parts 150 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served unprioritized served unprioritized --kernels served --out $OUT/parts.json
grep -A8 "read bandwidth" $OUT/parts.txt
grep -A20 "batch 1, served: one layer" $OUT/parts.txt | head -21
step tests 150 python3 -m pytest -q tests/gpu/test_hopper_quantized.py tests/gpu/test_hopper_engine.py
tail -2 $OUT/tests.txt
