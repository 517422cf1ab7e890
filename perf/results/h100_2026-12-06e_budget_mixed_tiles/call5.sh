#!/bin/bash
# Stop 47, call 5: MXFP8 tiles at a mixed step's M (80-512) against the served plan and the
# dequantized path, on the slice's four projections.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 450 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep > $OUT/mid.txt 2>&1; echo rc=$?
grep -v Warning $OUT/mid.txt | head -60
