#!/bin/bash
# Stop 48, call 1 (one call for the two changes; device time was short): the GPU test of
# --mxfp8-bf16-copy, then the slice served on one machine by a2a7568 (`.scratch/base`, its
# m3serve and perf) without the copy, the same with --mxfp8-bf16-copy, and this tree
# (the mixed budget growing past the stretch while most steps are mixed); C 16, 64, 128.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
levels=(c16:16:256 c64:64:256:probe c128:128:256)
ln -sfn "$PWD/.whl" .scratch/base/.whl
mkdir -p .scratch/base/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/base/.scratch/
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile" | sort -u | tail -12; }
timeout 100 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -2
(cd .scratch/base && bash perf/h200_serve_slice.sh --tag base "${levels[@]}") > /tmp/b.out 2>&1; echo "== base"; show /tmp/b.out
(cd .scratch/base && bash perf/h200_serve_slice.sh --tag copy --serve-arg --mxfp8-bf16-copy "${levels[@]}") > /tmp/c.out 2>&1; echo "== copy"; show /tmp/c.out
bash perf/h200_serve_slice.sh --tag busy "${levels[@]}" > /tmp/busy.out 2>&1; echo "== busy"; show /tmp/busy.out
zcat $OUT/busy_serve.log.gz 2> /dev/null | grep "prompt budget now" | tail -6 | cut -c1-300
rm -f $OUT/*serve.log.gz $OUT/tcache.tgz.part*
