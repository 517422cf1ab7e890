#!/usr/bin/env bash
# Stop 56 call 11 (~400 s left): on an H200, issue 10's layer rows in brief; on an H100, the
# indexer's block scores with 1 page a program.
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
. perf/device_env.sh
case $gpu in
  *H200*)
    step parts 100 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
      --variants served serial no_shared no_routed no_moe --out "$OUT/parts.json"
    grep -A9 "read bandwidth" "$OUT/parts.txt"
    step moe_layer 120 python3 perf/bench_moe_layer.py --out "$OUT/moe_layer.json"
    tail -8 "$OUT/moe_layer.txt"
    ;;
  *)
    step scores 120 python3 .scratch/s56/scores_pages.py
    cat "$OUT/scores.txt"
    ;;
esac
