#!/bin/bash
# Session 44 call 2: the same A/B in the other order, then the whole table with the floor at 128.
nvidia-smi --query-gpu=name --format=csv,noheader
bash perf/h200_serve_slice.sh --tag r256 c16:16:384 c64:64:256:probe
bash perf/h200_serve_slice.sh --tag r128 --serve-arg --mixed-step-min-tokens --serve-arg 128 \
  c1:1:12 c16:16:384 c64:64:256:probe c128:128:256 c256:256:512
