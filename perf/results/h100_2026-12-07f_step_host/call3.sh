#!/bin/bash
# Session 58, call 3: served A/B on one machine: HEAD's package (base: every step draws outside
# its graph), then this tree's (new), the slice at C 1 and 16.
nvidia-smi --query-gpu=name --format=csv,noheader
mv m3serve /tmp/m3serve_new && cp -r .scratch/s58/base/m3serve .
bash perf/h200_serve_slice.sh --tag base c1:1:24 c16:16:192 > $OUT/base_console.txt 2>&1
tail -30 $OUT/base_console.txt | grep -v "^\s*$" | tail -6
rm -rf m3serve && mv /tmp/m3serve_new m3serve
bash perf/h200_serve_slice.sh --tag new c1:1:24 c16:16:192 > $OUT/new_console.txt 2>&1
tail -30 $OUT/new_console.txt | grep -v "^\s*$" | tail -6
grep -E "^decode|^== |inter-token" $OUT/new_trace.txt | head -12
