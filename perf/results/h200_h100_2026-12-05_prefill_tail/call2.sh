#!/bin/bash
. perf/device_env.sh
t0=$(date +%s)
PYTHONPATH=$PWD:$PWD/perf:$PYTHONPATH timeout 400 python3 perf/results/h200_h100_2026-12-05_prefill_tail/gluon_prefill_check.py 2>&1 | grep -v Warning | tail -30
echo "done $(( $(date +%s)-t0 ))s"
