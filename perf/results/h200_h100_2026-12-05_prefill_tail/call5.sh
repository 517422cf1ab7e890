#!/bin/bash
. perf/device_env.sh
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nvfp4_moe_gpu.py 2>&1 | tail -4
echo "tests $(( $(date +%s)-t0 ))s"
PYTHONPATH=$PWD:$PWD/perf:$PYTHONPATH timeout 220 python3 perf/results/h200_h100_2026-12-05_prefill_tail/prefill_tail.py 2>&1 | grep -v Warn | tail -16
echo "done $(( $(date +%s)-t0 ))s"
