#!/bin/bash
. perf/device_env.sh
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nvfp4_moe_gpu.py 2>&1 | tail -2
echo "nvfp4 tests $(( $(date +%s)-t0 ))s"
PYTHONPATH=$PWD/perf:$PYTHONPATH timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 1,32 --prefill 2048 --no-grouped --out $OUT/bench_nvfp4_moe.json 2>&1 | grep -v Warn | tail -9
echo "bench $(( $(date +%s)-t0 ))s"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hopper_quantized.py 2>&1 | tail -2
echo "done $(( $(date +%s)-t0 ))s"
