#!/bin/bash
# Stop 61, call A: HEAD's issue-11 table (budget sized ahead, never-served buckets at the
# served pace), then where a mixed step's host launch goes (bench_step_host --chunk) at 16 rows
# with 256- and 96-token chunks.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
bash perf/h200_serve_slice.sh --tag ahead > $OUT/ahead_console.txt 2>&1
grep -E "^concurrency" $OUT/ahead_console.txt
grep -E "^== |inter-token|^mixed|^decode" $OUT/ahead_trace.txt | cut -c1-190 | head -40
step host256 150 bash -c "cd perf && python3 bench_step_host.py --model-path /tmp/slice --batches 16 --iters 100 --profile-iters 40 --chunk 256 --out $OUT/host256.json"
step host96 150 bash -c "cd perf && python3 bench_step_host.py --model-path /tmp/slice --batches 16 --iters 100 --profile-iters 40 --chunk 96 --out $OUT/host96.json"
sed -n '/^host/,/^== torch/p' $OUT/host256.txt | head -45
sed -n '/^part/,/^== torch/p' $OUT/host96.txt | head -45
cd $OUT && tar czf packed.tgz --remove-files $(ls | grep -vE "^(ahead_trace.txt|host256.txt|host96.txt|tcache.tgz.part.*)$") ; ls $OUT
