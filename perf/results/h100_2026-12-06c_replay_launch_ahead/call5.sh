#!/bin/bash
# Session 45, call 5 (carry .whl, .scratch/tcache.tgz.partaa): the GPU tests of --launch-ahead.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 200 python3 -m pytest -q tests/gpu/test_hopper_engine.py tests/gpu/test_host_copy_gpu.py \
  -k "launched_ahead or overlap or download or uploads" 2>&1 | tail -4
