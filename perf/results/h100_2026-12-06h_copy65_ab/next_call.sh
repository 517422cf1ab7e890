#!/bin/bash
# For the next session (not run: no device time was left), two things written in stop 50 and
# never run on a GPU: (1) does a prompt chunk's forward hide beside the decode step on a second
# stream (perf/bench_overlap_step.py)? The 4-layer slice as h200_serve_slice.sh makes it, then
# the bench at the C 16 and C 64 loads' decode batches (over ~1.2K tokens; 296 prompt tokens a
# decode step at C 64) and around them. (2) the NVFP4 MoE prefill with blocks of 128 pairs on
# 64 weight rows, two programs an SM (bench_nvfp4_moe.py's block_m128_n64_w4_s2), at the
# slice's mixed steps (8 experts) and at 128 experts. Carry `.whl` and `.scratch`
# (tcache.tgz.part*). ~5 min.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
slice=/tmp/slice
[ -f "$slice/config.json" ] || python3 -m m3serve make-tiny "$slice" --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
for b in 16 64; do
  timeout 200 python3 perf/bench_overlap_step.py --model-path "$slice" --batch $b \
    --prompts 128 296 512 --context 1184 --out /tmp/overlap_$b.json > $OUT/overlap_$b.txt 2>&1
  echo "batch $b rc=$?"; grep -v Warning $OUT/overlap_$b.txt | tail -6
done
v=default,block_m128_n64_w4_s2
timeout 120 python3 perf/bench_nvfp4_moe.py --tokens '' --prefill 272,414,640 --experts 8 \
  --no-grouped --prefill-ablations --variants $v --out /tmp/e8.json > $OUT/moe_e8.txt 2>&1
echo "e8 rc=$?"; grep -E "prefill T|default|block_m128" $OUT/moe_e8.txt
timeout 150 python3 perf/bench_nvfp4_moe.py --tokens '' --prefill 2048,8192 --no-grouped \
  --prefill-ablations --variants $v --out /tmp/e128.json > $OUT/moe_e128.txt 2>&1
echo "e128 rc=$?"; grep -E "prefill T|default|block_m128|dense" $OUT/moe_e128.txt
