#!/bin/bash
# Session 57, call 5 (carry .whl, .scratch/s57, .scratch/tcache.tgz.partaa): the final sampler:
# GPU tests, the kernel A/B against HEAD's, and the server's no-compile-after-ready test.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 200 python3 -m pytest -q tests/gpu/test_sampling_gpu.py tests/unit/core/test_sampler.py
tail -3 $OUT/tests.txt
step base 120 env PYTHONPATH=/tmp/site:$PWD/.scratch/s57/base python3 .scratch/s57/sample_ab.py
step ab 200 python3 .scratch/s57/sample_ab.py
cat $OUT/base.txt $OUT/ab.txt
step nocompile 280 python3 -m pytest -q -x tests/gpu/test_no_compiles_after_ready.py -k "not spec"
tail -3 $OUT/nocompile.txt
