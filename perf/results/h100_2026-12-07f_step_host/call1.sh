#!/bin/bash
# Session 58, call 1: where a served decode step's host time goes. The 4-layer slice served at
# C 1 (py-spy of every server process for 4 s) and C 16, then the step runner's host parts
# (perf/bench_step_host.py) at batch 1, 16 and 64 on the same slice.
nvidia-smi --query-gpu=name --format=csv,noheader
nproc; lscpu | grep -E "Model name|MHz" | head -3
bash perf/h200_serve_slice.sh --tag spy --py-spy c1 c1:1:24 c16:16:192 > $OUT/spy_console.txt 2>&1
tail -30 $OUT/spy_console.txt | grep -v "^\s*$" | tail -16
tar xzf $OUT/spy_results.tgz -C /tmp res/py_spy_c1.txt.gz
python3 .scratch/s58/py_spy_executor.py /tmp/res/py_spy_c1.txt.gz > $OUT/spy_executor.txt 2>&1
head -70 $OUT/spy_executor.txt
. perf/device_env.sh
cd perf && timeout 300 python3 bench_step_host.py --model-path /tmp/slice --batches 1 16 64 \
  --iters 300 --profile-iters 100 > $OUT/host.txt 2>&1; echo "host rc=$?"
head -40 $OUT/host.txt
