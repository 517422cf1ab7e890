#!/bin/bash
# Session 58, call 4: GPU tests around the graph draw, then the slice's serving table (C 1-128)
# with decode graphs drawing their rows, and a C 16 level under py-spy (mixed-step launches).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 200 python3 -m pytest -q tests/gpu/test_hopper_engine.py tests/gpu/test_sampling_gpu.py tests/gpu/test_host_copy_gpu.py tests/gpu/test_no_compiles_after_ready.py -k "not spec"
tail -4 $OUT/tests.txt
bash perf/h200_serve_slice.sh --tag table --py-spy c16s c1:1:24 c16:16:192 c64:64:256:probe c128:128:256 c16s:16:160 > $OUT/table_console.txt 2>&1
tail -40 $OUT/table_console.txt | grep -E "^concurrency|of ideal|ready|done"
grep -E "^decode|^mixed|^== |inter-token" $OUT/table_trace.txt | cut -c1-250 | head -40
tar xzf $OUT/table_results.tgz -C /tmp res/py_spy_c16s.txt.gz && python3 .scratch/s58/py_spy_executor.py /tmp/res/py_spy_c16s.txt.gz > $OUT/spy_executor.txt 2>&1
head -60 $OUT/spy_executor.txt
