#!/usr/bin/env bash
# Stop 56 call 2: the shared expert's GEMV rows a program (batch 1), the floors from the step's
# own routing (distinct tokens a row), bench_moe_layer's table with transformers.
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
. perf/device_env.sh
step parts 200 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served serial shared_rows8 shared_rows16 shared_rows32 no_shared no_moe \
  --kernels served shared_rows16 --out "$OUT/parts.json"
grep -A12 "read bandwidth" "$OUT/parts.txt"
step moe_layer 240 python3 perf/bench_moe_layer.py --out "$OUT/moe_layer.json"
tail -8 "$OUT/moe_layer.txt"
(cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
