#!/bin/bash
# Stop 47, call 8: 256-row MXFP8 tiles at a mixed step's M (160-512) against the dequantized path.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
timeout 200 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 160,192,256,320,384,512 \
  > $OUT/mid.txt 2>&1; echo rc=$?
grep -v Warning $OUT/mid.txt | grep -v "^$" | head -40
