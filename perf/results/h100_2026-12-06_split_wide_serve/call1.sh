#!/bin/bash
# Session 43 (carry .whl .scratch): T = 1 and 8 with K splits (the last split sums, in-kernel)
# and register caps; 256-row prefill tiles against the plan's; the split tests on the GPU.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 200 python3 .scratch/t1_occ.py 2>&1 | grep -v Warning | tail -8
timeout 170 python3 .scratch/wide_tiles.py 2>&1 | grep -v Warning | tail -8
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_nvfp4_moe_gpu.py -k "split" 2>&1 | tail -3
