#!/bin/bash
# Session 40, call 3 (carry .whl .scratch): last-block tails: GPU tests, served plan against no
# tail across T, the bench_nvfp4_moe numbers.
. perf/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step tests 240 python3 -m pytest -q tests/gpu/test_nvfp4_moe_gpu.py tests/unit/kernels/triton/test_nvfp4_moe_align_triton.py
tail -2 $OUT/tests.txt
step tail3 200 env PYTHONPATH=$PWD/perf:$PYTHONPATH python3 perf/results/h200_2026-12-05_last_block_tail/tails.py call3
grep -E "dense|^E" $OUT/tail3.txt
step bench 150 python3 perf/bench_nvfp4_moe.py --tokens 1,32 --prefill 2048 --no-grouped --out $OUT/bench_nvfp4_moe.json
tail -8 $OUT/bench.txt
