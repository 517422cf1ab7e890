#!/usr/bin/env bash
# Stop 56 call 3: on an H200, issue 10's table (perf/h200_layer_table.sh --ablations); on an
# H100, the MXFP8 GEMV's own ceiling (L2-resident weight) across plans.
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; date -u
case $gpu in
  *H200*) bash perf/h200_layer_table.sh --ablations ;;
  *)
    . perf/device_env.sh
    step gemv_l2 300 python3 .scratch/s56/gemv_l2.py
    cat "$OUT/gemv_l2.txt"
    ;;
esac
