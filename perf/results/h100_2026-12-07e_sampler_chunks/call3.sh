#!/bin/bash
# Session 57, call 3: the sampler, HEAD's (baseline package in .scratch/s57/base) against this tree.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step base 150 env PYTHONPATH=/tmp/site:$PWD/.scratch/s57/base python3 .scratch/s57/sample_ab.py
cat $OUT/base.txt
step ab 240 python3 .scratch/s57/sample_ab.py
cat $OUT/ab.txt
step tests 150 python3 -m pytest -q tests/gpu/test_sampling_gpu.py
tail -2 $OUT/tests.txt
