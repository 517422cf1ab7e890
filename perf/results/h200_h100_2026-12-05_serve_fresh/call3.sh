#!/bin/bash
# Issue 11: the serving table with a prompt seed per level (no level resends cached prompts).
bash perf/h200_serve_slice.sh c1:1:12 c16:16:192 c64:64:256:probe c128:128:256 c256:256:512 2>&1 | tee $OUT/log.txt
