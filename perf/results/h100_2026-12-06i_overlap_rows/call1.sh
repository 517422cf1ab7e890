#!/bin/bash
# Stop 51, call 1: stop 50's next_call.sh (overlap bench + two-programs-an-SM prefill ablation)
# then the MXFP8 mid sweep at 33-64 rows (is 48 rows really slower than 64 on one decode tile?).
t0=$(date +%s)
bash perf/results/h100_2026-12-06h_copy65_ab/next_call.sh
echo "== next_call done at $(($(date +%s) - t0)) s"
. perf/device_env.sh > /dev/null
timeout 150 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 33,40,48,56,64,48 \
  --out /tmp/mid.json > $OUT/mid.txt 2>&1
echo "mid rc=$?"; grep -E "served|bandwidth" $OUT/mid.txt
echo "done at $(($(date +%s) - t0)) s"; ls $OUT
