#!/bin/bash
# Session 44 call 4 (carry .whl .scratch): the replayed layer launches on the GPU: tests, host
# time of mixed steps, then the slice served with them (new) and without (old: HEAD's tree).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/unit/backends/test_hopper_layer_loop.py \
  tests/unit/kernels/triton/test_launches.py > /tmp/tests.txt 2>&1
rc=$?; tail -4 /tmp/tests.txt; grep -E "^(FAILED|ERROR)" /tmp/tests.txt | head; [ $rc = 0 ] || { grep -B5 -A40 "Error\b" /tmp/tests.txt | head -80; exit 1; }
[ -f /tmp/slice/config.json ] || python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
timeout 90 python3 .scratch/prof_mixed.py /tmp/slice 2>&1 | grep "^=="
bash perf/h200_serve_slice.sh --tag new c16:16:384 c64:64:256:probe
cp -r .whl .scratch/old/ && mkdir -p .scratch/old/.scratch && cp .scratch/tcache.tgz.part* .scratch/old/.scratch/
cd .scratch/old && bash perf/h200_serve_slice.sh --tag old c16:16:384 c64:64:256
