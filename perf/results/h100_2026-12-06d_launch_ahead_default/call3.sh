#!/bin/bash
# --launch-ahead auto (on for a GPU) by default: its GPU tests, then the 4-layer slice served
# after a throwaway warm-up server (the first server of a call ran 5-20 % slower in calls 1-2,
# whichever tree it was): --launch-ahead off, auto with --mixed-step-min-tokens 128, auto (the
# default) at every level of the table.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
timeout 120 python3 -m pytest -q tests/gpu/test_hopper_engine.py -k "overlap or launched_ahead" 2>&1 | tail -2
bash perf/h200_serve_slice.sh --tag warm c1:1:8 c16:16:64 > /dev/null 2>&1
rm -f "$OUT"/warm_*
bash perf/h200_serve_slice.sh --tag off --serve-arg --launch-ahead --serve-arg off \
  c1:1:24 c16:16:256 c64:64:256:probe
bash perf/h200_serve_slice.sh --tag m128 --serve-arg --mixed-step-min-tokens --serve-arg 128 \
  c1:1:24 c16:16:256 c64:64:256:probe
bash perf/h200_serve_slice.sh --tag auto c1:1:24 c16:16:256 c64:64:256:probe c128:128:256 \
  c256:256:512
rm -f "$OUT"/*serve.log.gz
