#!/bin/bash
# Stop 47, call 6: the prefill MXFP8 tile at K steps of 128 with scale words (M > 64): the GPU
# test at real shapes, then the slice served by HEAD (base) first, this tree, base again.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
timeout 150 python3 -m pytest -q tests/gpu/test_mxfp8_linear_gpu.py 2>&1 | tail -3
levels=(c16:16:256 c64:64:256:probe c128:128:256)
ln -sfn "$PWD/.whl" .scratch/base/.whl
mkdir -p .scratch/base/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/base/.scratch/
(cd .scratch/base && bash perf/h200_serve_slice.sh --tag base1 "${levels[@]}") > /tmp/b1.out 2>&1; grep -v "^2026" /tmp/b1.out | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u
bash perf/h200_serve_slice.sh --tag new "${levels[@]}" > /tmp/new.out 2>&1; grep -v "^2026" /tmp/new.out | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u
(cd .scratch/base && bash perf/h200_serve_slice.sh --tag base2 "${levels[@]}") > /tmp/b2.out 2>&1; grep -v "^2026" /tmp/b2.out | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u
rm -f $OUT/*serve.log.gz $OUT/tcache.tgz.part*
