#!/bin/bash
# Call B (warm behind A): served A/B on one machine, base (d0ab4c5: decode steps built as
# batches) vs new (rows into the graph), C 1 / 16.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
mv m3serve /tmp/m3serve_new && cp -r .scratch/s60/base/m3serve .
bash perf/h200_serve_slice.sh --tag base c1:1:24 c16:16:192 > $OUT/base_console.txt 2>&1
rm -rf m3serve && mv /tmp/m3serve_new m3serve
bash perf/h200_serve_slice.sh --tag new c1:1:24 c16:16:192 > $OUT/new_console.txt 2>&1
grep -E "^concurrency|^ *[0-9]+ " $OUT/base_console.txt $OUT/new_console.txt
grep -E "^decode|^== |inter-token" $OUT/new_trace.txt | head -12
