#!/bin/bash
# Call A: the machine, the jitter probe, GPU tests of the decode-rows path, then the issue-11
# table with the new code (all five levels).
nvidia-smi --query-gpu=name --format=csv,noheader
ps -eo pid,pcpu,comm,args --sort=-pcpu | head -25 > $OUT/ps.txt
cd perf && python3 bench_host_jitter.py --seconds 12 > $OUT/jitter.txt 2>&1; cd ..
head -30 $OUT/jitter.txt
. perf/device_env.sh
step tests 200 python3 -m pytest -q -x tests/gpu/test_hopper_engine.py tests/gpu/test_host_copy_gpu.py
tail -3 $OUT/tests.txt
grep -E "FAIL|Error" $OUT/tests.txt | head -10
bash perf/h200_serve_slice.sh --tag table > $OUT/table_console.txt 2>&1
grep -E "^ready|^concurrency|^ *[0-9]+ " $OUT/table_console.txt | head -20
grep -E "^decode|^== |inter-token" $OUT/table_trace.txt | head -14
