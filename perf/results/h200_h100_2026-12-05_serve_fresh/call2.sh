#!/bin/bash
# Issue 11: the serving table at HEAD (the mixed-step budget in quanta of 32 tokens, executor
# holds on GPU), then the same C 16 / C 64 levels with --mixed-step-stretch 2.2.
t0=$(date +%s)
bash perf/h200_serve_slice.sh --tag a c1:1:12 c16:16:192 c64:64:256:probe c128:128:256 c256:256:512 2>&1 | tee $OUT/a_log.txt
echo "a done $(( $(date +%s)-t0 ))s"
bash perf/h200_serve_slice.sh --tag b --serve-arg --mixed-step-stretch --serve-arg 2.2 c16:16:192 c64:64:256:probe 2>&1 | tee $OUT/b_log.txt
echo "b done $(( $(date +%s)-t0 ))s"
