#!/usr/bin/env bash
# Stop 56 call 12: one page a decode score program: the indexer GPU tests, the scores probe,
# and the MoE layer at batch 1 and 8 (seeded; call 10 at 208d1cb: 159.2 / 372.9 µs).
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
. perf/device_env.sh
step tests 120 python3 -m pytest -q -x tests/gpu/test_indexer_gpu.py
tail -2 "$OUT/tests.txt"
step scores 60 python3 .scratch/s56/scores_pages.py
head -3 "$OUT/scores.txt"
step parts 90 python3 perf/bench_moe_layer_parts.py --batches 1 8 --variants served \
  --kernels served --out "$OUT/parts.json"
grep -E "_block_scores|_select_blocks" "$OUT/parts.txt"
grep -A3 "read bandwidth" "$OUT/parts.txt"
