#!/bin/bash
# Stop 47, call 4: a mixed step's fixed part at batch 64, kernel by kernel against the decode
# step, with both steps' traces; the staircase of prompt tokens at 16 and 64 decode rows.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
[ -f /tmp/slice/config.json ] || python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
timeout 400 python3 perf/bench_mixed_step.py --model-path /tmp/slice --batches 16 64 \
  --chunks 16 32 64 96 128 160 192 224 256 288 320 352 384 416 448 --top 25 --traces > $OUT/mixed.txt 2>&1; echo rc=$?
grep -B2 -A40 "^batch" $OUT/mixed.txt | head -45
grep -A30 "== kernels of the mixed" $OUT/mixed.txt
gzip $OUT/trace_*.json
