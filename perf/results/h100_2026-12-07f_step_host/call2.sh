#!/bin/bash
# Session 58, call 2: decode graphs that draw their rows. GPU tests of the change, the slice
# served at C 1 and 16 (the trace's new wait= / ahead=), then the step runner's host parts
# (graph draw vs eager draw, perf/bench_step_host.py) on that slice.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 240 python3 -m pytest -q -x tests/gpu/test_hopper_engine.py -k "graphs or overlap or launched" tests/gpu/test_host_copy_gpu.py
tail -3 $OUT/tests.txt
bash perf/h200_serve_slice.sh --tag new c1:1:24 c16:16:192 > $OUT/new_console.txt 2>&1
tail -30 $OUT/new_console.txt | grep -v "^\s*$" | tail -8
grep -E "^decode|^== |inter-token" $OUT/new_trace.txt | head -12
(cd perf && timeout 200 python3 bench_step_host.py --model-path /tmp/slice --batches 1 16 64 \
  --iters 200 --profile-iters 60 > $OUT/host.txt 2>&1; echo "host rc=$?")
head -44 $OUT/host.txt
