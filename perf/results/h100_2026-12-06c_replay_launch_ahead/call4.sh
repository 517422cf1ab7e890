#!/bin/bash
# Session 45, call 4 (carry .whl, .scratch/tcache.tgz.partaa, .scratch/old, this script): steps
# launched ahead (and the plan from a handed-over result waited for) served against HEAD
# (.scratch/old = 61c4d04's m3serve and perf), the same slice, levels and Triton cache; then the GPU tests of the change.
nvidia-smi --query-gpu=name --format=csv,noheader
levels=(c1:1:24 c16:16:384 c64:64:256:probe)
# The call ran the change before it became a flag (always on); at the commit it is:
bash perf/h200_serve_slice.sh --tag new --serve-arg --launch-ahead "${levels[@]}"
ln -sfn "$PWD/.whl" .scratch/old/.whl
mkdir -p .scratch/old/.scratch && ln -sf "$PWD/.scratch/tcache.tgz.partaa" .scratch/old/.scratch/
(cd .scratch/old && bash perf/h200_serve_slice.sh --tag old "${levels[@]}")
. perf/device_env.sh
timeout 120 python3 -m pytest -q tests/gpu/test_host_copy_gpu.py tests/gpu/test_hopper_engine.py \
  -k "download or uploads or overlap or cuda_graphs" 2>&1 | tail -4
