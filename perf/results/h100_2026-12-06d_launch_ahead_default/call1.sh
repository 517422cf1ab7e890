#!/bin/bash
# Next session, call 1 (carry .whl, .scratch/tcache.tgz.partaa, .scratch/old = 61c4d04's m3serve
# and perf, this script), ~7 min: the GPU tests of stop 45's default-path trims (decode graphs'
# padding resets, the device draw's knobs), then the 4-layer slice served at HEAD against 61c4d04.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 150 python3 -m pytest -q tests/gpu/test_hopper_engine.py tests/unit/core/test_sampler.py \
  tests/gpu/test_sampling_gpu.py -k "cuda or graphs or overlap or launched_ahead" 2>&1 | tail -3
levels=(c1:1:24 c16:16:384 c64:64:256:probe)
bash perf/h200_serve_slice.sh --tag head "${levels[@]}"
ln -sfn "$PWD/.whl" .scratch/old/.whl
mkdir -p .scratch/old/.scratch && ln -sf "$PWD/.scratch/tcache.tgz.partaa" .scratch/old/.scratch/
(cd .scratch/old && bash perf/h200_serve_slice.sh --tag old "${levels[@]}")
