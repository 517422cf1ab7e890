#!/bin/bash
# Session 45, call 2 (carry .whl, .scratch/tcache.tgz.partaa, .scratch/prof_decode.py): where a
# served decode step's device time goes on the slice, then the replay's tests on the GPU.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
t0=$(date +%s)
python3 -m m3serve make-tiny /tmp/slice --vocab-size 32768 \
  --hidden-size 6144 --num-layers 4 --num-heads 64 --num-kv-heads 4 --head-dim 128 \
  --rotary-dim 64 --dense-layers 0 --intermediate-size 3072 --num-experts 8 \
  --num-experts-per-tok 4 --index-head-dim 128 --index-block-size 128 --index-topk-blocks 16 \
  --shards 4 --quant modelopt-mixed --device cuda > /tmp/make.log 2>&1 || { tail -20 /tmp/make.log; exit 1; }
echo "slice made after $(($(date +%s) - t0)) s"
timeout 300 python3 .scratch/prof_decode.py /tmp/slice 2>&1 | grep -v Warning | tee $OUT/prof_decode.txt | head -c 9000
echo "profile done after $(($(date +%s) - t0)) s"
timeout 120 python3 -m pytest -q -x tests/unit/backends/test_hopper_layer_loop.py tests/unit/kernels/triton/test_launches.py 2>&1 | tail -3
return_triton_cache
