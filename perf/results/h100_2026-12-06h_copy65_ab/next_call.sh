#!/bin/bash
# For the next session (not run: no device time was left): does a prompt chunk's forward hide
# beside the decode step on a second stream (perf/bench_overlap_step.py, written in stop 50 and
# never run on a GPU)? The 4-layer slice as h200_serve_slice.sh makes it, then the bench at the
# C 64 load's decode batch and prompt tokens a step (64 rows over ~1.2K tokens; 296 prompt
# tokens a decode step) and around it. Carry `.whl` and `.scratch` (tcache.tgz.part*). ~3 min.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
slice=/tmp/slice
[ -f "$slice/config.json" ] || python3 -m m3serve make-tiny "$slice" --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
timeout 400 python3 perf/bench_overlap_step.py --model-path "$slice" --batch 64 \
  --prompts 128 296 512 --context 1184 > $OUT/overlap.txt 2>&1
echo "rc=$?"; cat $OUT/overlap.txt | grep -v Warning | tail -12
