#!/bin/bash
. perf/device_env.sh
PYTHONPATH=$PWD:$PWD/perf:$PYTHONPATH timeout 300 python3 perf/results/h200_h100_2026-12-05_prefill_tail/prefill_split.py 2>&1 | grep -v Warning | tail -20
