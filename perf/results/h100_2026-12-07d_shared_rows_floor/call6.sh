#!/usr/bin/env bash
# Stop 56 call 6: on an H200, issue 10's table first; on any GPU, the align kernels' warps and
# bench_moe_layer at batch 8 after the routed_ids mend.
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
case $gpu in *H200*) bash perf/h200_layer_table.sh --ablations ;; esac
. perf/device_env.sh
step align 90 python3 .scratch/s56/align_warps.py
cat "$OUT/align.txt"
step moe_layer 120 python3 perf/bench_moe_layer.py --batches 8 --no-hf --out "$OUT/moe_layer.json"
tail -3 "$OUT/moe_layer.txt"
