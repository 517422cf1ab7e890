#!/bin/bash
# Session 44 (carry .whl .scratch): the mixed-step floor, 128 against 256, served in one call.
nvidia-smi --query-gpu=name --format=csv,noheader
bash perf/h200_serve_slice.sh --tag m128 --serve-arg --mixed-step-min-tokens --serve-arg 128 \
  c16:16:384 c64:64:256:probe
bash perf/h200_serve_slice.sh --tag m256 c16:16:384 c64:64:256:probe
