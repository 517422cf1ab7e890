#!/bin/bash
# Stop 47, call 2 (same warm machine; carry .whl, .scratch/old47 = 4747123's m3serve and perf,
# the Triton cache parts): 4747123 (budget fed run wall time) against HEAD (fed device time),
# then 4747123 again, at C 16 and 64.
nvidia-smi --query-gpu=name --format=csv,noheader
levels=(c16:16:256 c64:64:256:probe)
ln -sfn "$PWD/.whl" .scratch/old47/.whl
mkdir -p .scratch/old47/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/old47/.scratch/ 2>/dev/null
(cd .scratch/old47 && bash perf/h200_serve_slice.sh --tag old "${levels[@]}") > /tmp/old.out 2>&1; grep -v "^2026" /tmp/old.out | tail -8
bash perf/h200_serve_slice.sh --tag head "${levels[@]}" > /tmp/head.out 2>&1; grep -v "^2026" /tmp/head.out | tail -8
(cd .scratch/old47 && bash perf/h200_serve_slice.sh --tag old2 "${levels[@]}") > /tmp/old2.out 2>&1; grep -v "^2026" /tmp/old2.out | tail -8
rm -f $OUT/*serve.log.gz $OUT/tcache.tgz.part*
