#!/bin/bash
# Call 4 (same warm machine as call 3, whose auto server the 600 s limit cut): the GPU tests of
# the default (auto launches ahead on a GPU).
. perf/device_env.sh >/dev/null 2>&1; timeout 150 python3 -m pytest -q tests/gpu/test_hopper_engine.py -k "overlap or launched_ahead" 2>&1 | tail -3
