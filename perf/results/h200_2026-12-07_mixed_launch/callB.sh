#!/bin/bash
# Stop 61, call B (warm behind A): mixed steps made short at C 16 / 64: a floor of 128
# prompt tokens with a stretch of 2.0, and 96 with 1.8 (most steps then carry a chunk), against
# call A's HEAD defaults (256, 2.5).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
bash perf/h200_serve_slice.sh --tag f128 --serve-arg --mixed-step-min-tokens --serve-arg 128 --serve-arg --mixed-step-stretch --serve-arg 2.0 c16:16:192 c64:64:256:probe > $OUT/f128_console.txt 2>&1
grep -E "^concurrency" $OUT/f128_console.txt
grep -E "^== |inter-token|^mixed|^decode" $OUT/f128_trace.txt | cut -c1-190 | head -24
bash perf/h200_serve_slice.sh --tag f96 --serve-arg --mixed-step-min-tokens --serve-arg 96 --serve-arg --mixed-step-stretch --serve-arg 1.8 c16:16:192 c64:64:256:probe > $OUT/f96_console.txt 2>&1
grep -E "^concurrency" $OUT/f96_console.txt
grep -E "^== |inter-token|^mixed|^decode" $OUT/f96_trace.txt | cut -c1-190 | head -24
cd $OUT && tar czf packed.tgz --remove-files $(ls | grep -vE "^(f128_trace.txt|f96_trace.txt|tcache.tgz.part.*)$") ; ls $OUT
