#!/bin/bash
# Stop 51, call 3: where a C 64 mixed step's time goes, by kernel (bench_mixed_step --top) at
# 64 decode rows + 296 prompt tokens, context 1184; then issue 11's table at C 1, 16, 64 on HEAD.
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
. perf/device_env.sh > /dev/null
slice=/tmp/slice
python3 -m m3serve make-tiny "$slice" --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
timeout 180 python3 perf/bench_mixed_step.py --model-path $slice --batches 16 64 96 --chunks 296 \
  --context 1184 --top 25 --out /tmp/mixed.json > $OUT/mixed_top.txt 2>&1
echo "mixed rc=$? at $(($(date +%s) - t0)) s"; grep -v Warning $OUT/mixed_top.txt | tail -90
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile|start-up" | sort -u | tail -14; }
timeout 330 bash perf/h200_serve_slice.sh --tag table c1:1:12 c16:16:192 c64:64:256:probe > /tmp/t.out 2>&1
echo "== table rc=$? at $(($(date +%s) - t0)) s"; show /tmp/t.out
ls $OUT
