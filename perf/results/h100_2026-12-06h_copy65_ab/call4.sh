#!/bin/bash
# Stop 50, call 4 (what the last device minutes could hold): issue 11's table at HEAD at
# C 1, 16 and 64 (with the decode probe), on whichever machine came.
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile|start-up" | sort -u | tail -14; }
timeout 400 bash perf/h200_serve_slice.sh --tag table c1:1:12 c16:16:192 c64:64:256:probe > /tmp/t.out 2>&1
echo "== table rc=$? at $(($(date +%s) - t0)) s"; show /tmp/t.out
rm -f $OUT/tcache.tgz.part*
ls $OUT
