#!/bin/bash
# Stop 48, call 3: the held bf16 copy on by default and read from 65 rows (1101516, the busy
# growth reverted): its GPU test, then served at C 16, 64, 128.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u | tail -12; }
timeout 100 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -3
bash perf/h200_serve_slice.sh --tag copy65 c16:16:256 c64:64:256:probe c128:128:256 > /tmp/c.out 2>&1; echo "== copy65"; show /tmp/c.out
grep -h "bytes\|GB" /tmp/serve.log | grep -i "load" | head -3
rm -f $OUT/*serve.log.gz $OUT/tcache.tgz.part*
