#!/bin/bash
# Next session, one call (carry [".whl", ".scratch"]): the Gluon W4A16 draft's first run, then
# C 16's ITL ratio on the slice —
# a: the default (--mixed-step-min-tokens 256, 4 client processes); b: min tokens 192;
# c: the default with 8 client processes (the client's own share of the p99).
. perf/device_env.sh
t0=$(date +%s)
# The Gluon W4A16 draft: exactness and its T = 1 time (never run before; ~1 min).
PYTHONPATH=$PWD:$PWD/perf:$PYTHONPATH timeout 150 python3 perf/results/h200_h100_2026-12-05_prefill_tail/gluon_w4a16_check.py 2>&1 | tail -12
PYTHONPATH=$PWD/perf:$PYTHONPATH timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 --prefill 0 --no-grouped --out $OUT/moe.json 2>&1 | tail -8
bash perf/h200_serve_slice.sh --tag a c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
bash perf/h200_serve_slice.sh --tag b --serve-arg --mixed-step-min-tokens --serve-arg 192 \
  c16:16:192 c64:64:256:probe 2>&1 | grep -v "^2026"
bash perf/h200_serve_slice.sh --tag c --client-procs 8 c16:16:192 2>&1 | grep -v "^2026"
echo "done $(( $(date +%s)-t0 ))s"
