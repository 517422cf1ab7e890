#!/bin/bash
# Stop 47, call 3: where the mixed step's 1.5 ms jump at 64 prompt tokens comes from.
. perf/device_env.sh
timeout 400 python3 perf/bench_mixed_step.py --model-path /tmp/slice --batches 16 \
  --chunks 16 32 48 64 80 96 128 192 256 --top 20 > $OUT/mixed.txt 2>&1; echo rc=$?
tail -60 $OUT/mixed.txt
