#!/bin/bash
# Stop 47, call 1 (carry .whl, this script), ~7 min cold: the GPU tests of the device spans
# (416d7e2), the host copy, the default launching ahead; then HEAD served at C 16/64 as the
# call's first (throwaway-grade) server, compiling the Triton cache that comes back.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 120 python3 -m pytest -q tests/gpu/test_device_clock_gpu.py tests/gpu/test_host_copy_gpu.py 2>&1 | tail -15
timeout 150 python3 -m pytest -q tests/gpu/test_hopper_engine.py -k "overlap or launched_ahead" 2>&1 | tail -3
bash perf/h200_serve_slice.sh --tag warm c16:16:256 c64:64:256:probe > /tmp/warm.out 2>&1; grep -v "^2026" /tmp/warm.out | tail -14
rm -f $OUT/*serve.log.gz
