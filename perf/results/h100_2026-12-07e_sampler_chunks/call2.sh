#!/bin/bash
# Session 57, call 2 (carry .whl, .scratch/s57): the chunked sampler on the GPU: tests, A/B.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 200 python3 -m pytest -q tests/gpu/test_sampling_gpu.py -s
grep -E "passed|failed|Error|sampling, B|triton" $OUT/tests.txt | head -30
step ab 300 python3 .scratch/s57/sample_ab.py
cat $OUT/ab.txt
