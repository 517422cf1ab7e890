#!/bin/bash
# GIL switch interval A/B on the served slice: a = the engine's 0.5 ms (SWITCH_INTERVAL_S),
# b = 0.2 ms in every process (sitecustomize). C 16 and C 64 (probe), fresh prompts.
. perf/device_env.sh
t0=$(date +%s)
bash perf/h200_serve_slice.sh --tag a c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
cat > /tmp/site/sitecustomize.py <<'PY'
import sys

sys.setswitchinterval(0.0002)
PY
bash perf/h200_serve_slice.sh --tag b c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
rm -f /tmp/site/sitecustomize.py
echo "done $(( $(date +%s)-t0 ))s"
