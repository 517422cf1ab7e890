#!/bin/bash
# For the next session (not yet run): one call, ~8.5 min on a fresh machine without a carried
# Triton cache (carry `.whl`, and `.scratch/tcache.tgz.part*` if any). The GPU tests of
# --mxfp8-bf16-copy, the mid sweep with the held copy, then the slice served with the copy first
# (the first server of a call runs slower: against the copy) and without it.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
timeout 150 python3 -m pytest -q tests/gpu/test_hopper_quantized.py tests/gpu/test_mxfp8_linear_gpu.py 2>&1 | tail -3
timeout 200 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 128,256,384 \
  > $OUT/mid.txt 2>&1; grep -E "served|differs" $OUT/mid.txt
levels=(c16:16:256 c64:64:256:probe c128:128:256)
for tag in copy a; do
  extra=(); [ $tag = copy ] && extra=(--serve-arg --mxfp8-bf16-copy)
  bash perf/h200_serve_slice.sh --tag $tag "${extra[@]}" "${levels[@]}" > /tmp/$tag.out 2>&1
  echo "== $tag"; grep -E "ready|^concurrency [0-9]+ |ideal|compile" /tmp/$tag.out | grep -v "^2026" | sort -u
done
rm -f $OUT/*serve.log.gz  # six files and the Triton cache parts: within the eight that come back
