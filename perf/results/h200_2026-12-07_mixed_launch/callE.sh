#!/bin/bash
# Stop 61, call E (the device time left): the draw paths' GPU tests, then new (the piecewise
# steps' draw in graphs) and base (7cfbce1) served at C 16 on one machine.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh
step tests 90 python3 -m pytest -q -x tests/gpu/test_hopper_engine.py -k "draw"
tail -3 $OUT/tests.txt
timeout 100 bash perf/h200_serve_slice.sh --tag new c16:16:192 > $OUT/new_console.txt 2>&1
rm -f $OUT/tcache.tgz.part*
grep -E "^concurrency" $OUT/new_console.txt
grep -E "^mixed|inter-token" $OUT/new_trace.txt | cut -c1-200 | head -4
mv m3serve /tmp/m3serve_new && cp -r .scratch/s62/base/m3serve .
timeout 90 bash perf/h200_serve_slice.sh --tag base c16:16:192 > $OUT/base_console.txt 2>&1
rm -rf m3serve && mv /tmp/m3serve_new m3serve
rm -f $OUT/tcache.tgz.part*
grep -E "^concurrency" $OUT/base_console.txt
grep -E "^mixed|inter-token" $OUT/base_trace.txt | cut -c1-200 | head -4
