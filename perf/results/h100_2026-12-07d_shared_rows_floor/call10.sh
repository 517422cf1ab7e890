#!/usr/bin/env bash
# Stop 56 call 10 (~470 s of budget left): on an H200, issue 10's layer and kernel rows in
# brief; on an H100, the seeded layer parts at HEAD (a baseline for the next A/Bs).
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
. perf/device_env.sh
step parts 100 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
  --variants served serial no_shared no_routed no_moe --out "$OUT/parts.json"
grep -A9 "read bandwidth" "$OUT/parts.txt"
case $gpu in
  *H200*)
    step moe_layer 120 python3 perf/bench_moe_layer.py --out "$OUT/moe_layer.json"
    tail -8 "$OUT/moe_layer.txt"
    step nvfp4_moe 120 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 --prefill 2048 \
      --no-grouped --out "$OUT/nvfp4_moe.json"
    tail -15 "$OUT/nvfp4_moe.txt"
    ;;
esac
