#!/bin/bash
# --mixed-step-min-tokens 256 (default, a) against 192 (b), twice each on one machine, plus a
# thread-level top beside the first serve's C 64 level (the stall clusters).
t0=$(date +%s)
(sleep 118; top -b -H -n 4 -d 1 -w 200 | grep -E "^top|^ *[0-9]+ " | head -120 > $OUT/top.txt) &
for t in a1 b1 a2 b2; do
  extra=()
  case $t in b*) extra=(--serve-arg --mixed-step-min-tokens --serve-arg 192) ;; esac
  [ $(( $(date +%s)-t0 )) -lt 440 ] || break
  bash perf/h200_serve_slice.sh --tag $t "${extra[@]}" c16:16:192 c64:64:256:probe 2>&1 | grep -E "^ready|^concurrency 16 |^concurrency 64 |of ideal" | sort -u
  rm -f $OUT/${t}_serve.log.gz $OUT/${t}_results.tgz
done
echo "done $(( $(date +%s)-t0 ))s"
