#!/bin/bash
# Call E: the mixed budget sized for the batch a queue fills to (working tree) — the whole
# table, then HEAD (ef71d33, sized by the decoding rows) at C 128 / 256 on the same machine.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
bash perf/h200_serve_slice.sh --tag ahead > $OUT/ahead_console.txt 2>&1
grep -E "^ready|^concurrency|budget" $OUT/ahead_console.txt | cut -c1-400
mv m3serve /tmp/m3serve_new && cp -r .scratch/s60/prev/m3serve .
bash perf/h200_serve_slice.sh --tag rows c128:128:256 c256:256:512 > $OUT/rows_console.txt 2>&1
rm -rf m3serve && mv /tmp/m3serve_new m3serve
grep -E "^concurrency" $OUT/rows_console.txt
grep -E "^== |inter-token" $OUT/ahead_trace.txt $OUT/rows_trace.txt
