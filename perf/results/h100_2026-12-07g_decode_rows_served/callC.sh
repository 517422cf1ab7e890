#!/bin/bash
# Call C (warm behind A/B, /tmp/slice made): the host parts of a decode step three ways
# (rows, built batch, eager draw), then the no-compiles test.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step host 240 bash -c "cd perf && python3 bench_step_host.py --model-path /tmp/slice --batches 1 16 64 --iters 200 --profile-iters 40"
sed -n 1,30p $OUT/host.txt
step nocompile 300 python3 -m pytest -q tests/gpu/test_no_compiles_after_ready.py -k "not spec"
tail -3 $OUT/nocompile.txt
