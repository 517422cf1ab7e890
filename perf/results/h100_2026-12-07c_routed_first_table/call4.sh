#!/usr/bin/env bash
# Stop 55 call 3 (the last ~240 s): bench_moe_layer after the dequant fix, batch 1 and 8.
set -u
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step moe_layer 100 python3 perf/bench_moe_layer.py --batches 1 8 --no-hf --out "$OUT/moe_layer.json"
tail -6 "$OUT/moe_layer.txt"
