#!/bin/bash
# Next session's first device call (carry .whl .scratch), ~9 min: the layer replay measured.
# .scratch/old is 701c1f5's tree (m3serve, perf) with the Triton cache it was built for and the
# wheels; .scratch holds no cache, so the first serve here packs a fresh one back (tcache.tgz.part*:
# move them into .scratch/ for later calls).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
[ -f /tmp/slice/config.json ] || python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
bash perf/h200_serve_slice.sh --tag new c16:16:384 c64:64:256:probe
timeout 150 python3 perf/bench_mixed_step.py --model-path /tmp/slice --batches 16 64 \
  --chunks 32 256 --top 0 --out /tmp/mixed.json 2>&1 | grep -v Warning | tail -9
(cd .scratch/old && bash perf/h200_serve_slice.sh --tag old c16:16:384 c64:64:256:probe)
