#!/bin/bash
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
[ -f /tmp/slice/config.json ] || python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
timeout 400 python3 .scratch/prof_mixed.py /tmp/slice 2>&1 | grep -v Warning
