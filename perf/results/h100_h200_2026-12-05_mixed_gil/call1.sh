#!/bin/bash
# Call 1 of session 37, one device call (carry [".whl", ".scratch"]; .scratch/tcache.tgz.partaa
# is the 12-05 H100 run's Triton cache of these kernels): no floor (a; the default then, since
# 6ddc528 --mixed-step-min-tokens 0) against --mixed-step-min-tokens 256 (b) at C 16 and C 64
# with fresh prompts; the traces carry launch= and gc=...(full N).
t0=$(date +%s)
bash perf/h200_serve_slice.sh --tag a --serve-arg --mixed-step-min-tokens --serve-arg 0 \
  c16:16:192 c64:64:256:probe 2>&1 | tee $OUT/a_log.txt
echo "a done $(( $(date +%s)-t0 ))s"
bash perf/h200_serve_slice.sh --tag b --serve-arg --mixed-step-min-tokens --serve-arg 256 \
  c16:16:192 c64:64:256:probe 2>&1 | tee $OUT/b_log.txt
echo "b done $(( $(date +%s)-t0 ))s"
