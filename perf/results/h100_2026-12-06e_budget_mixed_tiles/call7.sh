#!/bin/bash
# Stop 47, call 7 (same warm machine as call 6): the GPU tests the new MXFP8 prefill tile runs in.
. perf/device_env.sh > /dev/null
timeout 170 python3 -m pytest -q tests/gpu/test_hopper_quantized.py tests/gpu/test_piecewise_gpu.py 2>&1 | tail -3
timeout 250 python3 -m pytest -q tests/gpu/test_no_compiles_after_ready.py 2>&1 | tail -3
