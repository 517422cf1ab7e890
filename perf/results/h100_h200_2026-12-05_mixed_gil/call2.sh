#!/bin/bash
# 1) where a mixed step's time goes (wall vs host-queue vs device-busy, top ops);
# 2) serve C16/C64 with the new default (min tokens 256): a = as is, b = GIL switch interval
#    0.5 ms in every process (sitecustomize), to see whether served launch= is GIL waits.
. perf/device_env.sh
t0=$(date +%s)
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
echo "slice $(( $(date +%s)-t0 ))s"
timeout 200 python3 perf/bench_mixed_step.py --model-path /tmp/slice --batches 16 64 \
  --chunks 32 256 --context 1024 --top 45 --out $OUT/mixed.json > $OUT/mixed.txt 2>&1
head -16 $OUT/mixed.txt | grep -v Warn
echo "bench $(( $(date +%s)-t0 ))s"
bash perf/h200_serve_slice.sh --tag a c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
echo "a done $(( $(date +%s)-t0 ))s"
printf 'import sys\nsys.setswitchinterval(0.0005)\n' > /tmp/site/sitecustomize.py
PYTHONPATH=/tmp/site python3 -c "import sys; print('switch interval', sys.getswitchinterval())"
bash perf/h200_serve_slice.sh --tag b c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
echo "b done $(( $(date +%s)-t0 ))s"
