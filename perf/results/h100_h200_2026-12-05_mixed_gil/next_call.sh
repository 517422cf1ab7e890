#!/bin/bash
# Next session, one call (carry [".whl", ".scratch"]; the Triton cache in .scratch predates the
# prefill kernels' first_req, so those recompile once): the mixed-step attention split
# (AttentionConfig.mixed_decode_min_rows, off by default since b1fff4d) —
# (1) its GPU exactness, (2) bench_mixed_step off/on, (3) the slice served off (a) / on (b).
. perf/device_env.sh
t0=$(date +%s)
R=perf/results/h100_h200_2026-12-05_mixed_gil
python3 -m pytest -q -x tests/gpu/test_attention_gpu.py -k mixed 2>&1 | tail -3
echo "tests $(( $(date +%s)-t0 ))s"
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
for rows in 0 8; do
  timeout 150 python3 $R/bench_split.py $rows --model-path /tmp/slice --batches 16 64 \
    --chunks 32 256 --context 1024 --top 25 --out /tmp/mixed_$rows.json > $OUT/mixed_$rows.txt 2>&1
  echo "== split from $rows rows $(( $(date +%s)-t0 ))s"; grep -A5 "^batch" $OUT/mixed_$rows.txt
  grep "_prefill_kernel \|_decode_split_kernel " $OUT/mixed_$rows.txt | head -3 | cut -c1-60,150-215
done
bash perf/h200_serve_slice.sh --tag a c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
# b: the split on from 8 rows in every process (an experiment: no server flag sets it).
cat > /tmp/site/sitecustomize.py <<'PY'
import dataclasses

try:
    import m3serve.kernels.triton.attention as _attention
except ImportError:  # a process without torch/triton on its path
    pass
else:
    _attention.DEFAULT_CONFIG = dataclasses.replace(
        _attention.DEFAULT_CONFIG, mixed_decode_min_rows=8
    )
PY
bash perf/h200_serve_slice.sh --tag b c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
rm -f /tmp/site/sitecustomize.py
echo "done $(( $(date +%s)-t0 ))s"
