#!/bin/bash
# Session 57, call 6: the sampler's GPU tests after the scratch became two aligned allocations.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 150 python3 -m pytest -q tests/gpu/test_sampling_gpu.py tests/unit/core/test_sampler.py
tail -3 $OUT/tests.txt
