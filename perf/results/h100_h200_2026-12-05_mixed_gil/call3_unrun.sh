#!/bin/bash
# The mixed-step attention split: GPU exactness, then bench_mixed_step with it (default) and without.
. perf/device_env.sh
t0=$(date +%s)
python3 -m pytest -q -x tests/gpu/test_attention_gpu.py -k "mixed" 2>&1 | tail -4
echo "tests $(( $(date +%s)-t0 ))s"
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
for run in split nosplit; do
  rows=8; [ $run = nosplit ] && rows=0
  timeout 150 python3 perf/results/h100_h200_2026-12-05_mixed_gil/bench_split.py $rows --model-path /tmp/slice --batches 16 64 --chunks 32 256 \
    --context 1024 --top 25 --out $OUT/mixed_$run.json > $OUT/mixed_$run.txt 2>&1
  echo "== $run $(( $(date +%s)-t0 ))s"; grep -A8 "^batch" $OUT/mixed_$run.txt; grep "_kernel " $OUT/mixed_$run.txt | head -8 | cut -c1-60,150-215
done
