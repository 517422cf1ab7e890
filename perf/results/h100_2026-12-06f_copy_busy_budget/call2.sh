#!/bin/bash
# Stop 48, call 2 (the same warm machine as call 1): this tree (busy growth) with
# --mxfp8-bf16-copy served at C 16, 64, 128, then the mid sweep with the held copy at M 80-256.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u | tail -12; }
bash perf/h200_serve_slice.sh --tag busycopy --serve-arg --mxfp8-bf16-copy c16:16:256 c64:64:256:probe c128:128:256 > /tmp/bc.out 2>&1; echo "== busy+copy"; show /tmp/bc.out
timeout 150 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 80,128,256 \
  > $OUT/mid.txt 2>&1; grep -E "served|copy|differs" $OUT/mid.txt | head -30
rm -f $OUT/*serve.log.gz $OUT/tcache.tgz.part*
