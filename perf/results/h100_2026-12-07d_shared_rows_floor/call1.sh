#!/usr/bin/env bash
# Stop 56 call 1: on an H200, issue 10's table (perf/h200_layer_table.sh --ablations, its parts
# bench now with the stream-priority variants); on an H100, the priority variants and the
# seeded batch-8 difference of bench_moe_layer (with and without transformers).
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
case $gpu in
  *H200*)
    bash perf/h200_layer_table.sh --ablations
    ;;
  *)
    . perf/device_env.sh
    step parts 200 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
      --variants served serial routed_priority shared_priority no_shared no_moe \
      --kernels served routed_priority --out "$OUT/parts.json"
    grep -A10 "read bandwidth" "$OUT/parts.txt"
    step moe_layer_hf 150 python3 perf/bench_moe_layer.py --batches 1 8 --out "$OUT/moe_layer_hf.json"
    tail -5 "$OUT/moe_layer_hf.txt"
    step moe_layer 100 python3 perf/bench_moe_layer.py --batches 8 --no-hf --out "$OUT/moe_layer.json"
    tail -4 "$OUT/moe_layer.txt"
    (cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
    ;;
esac
