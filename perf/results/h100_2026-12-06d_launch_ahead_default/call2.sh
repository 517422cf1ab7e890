#!/bin/bash
# Order check: call 1 served HEAD first then 61c4d04, and HEAD's every launch (prefill too, code
# it did not touch) was 25-35 % slower in CPU time. Here the old tree first, then HEAD default,
# HEAD --launch-ahead, HEAD default again: same machine, same Triton cache.
nvidia-smi --query-gpu=name --format=csv,noheader
levels=(c1:1:24 c16:16:256 c64:64:256:probe)
ln -sfn "$PWD/.whl" .scratch/old/.whl
mkdir -p .scratch/old/.scratch && ln -sf "$PWD/.scratch/tcache.tgz.partaa" .scratch/old/.scratch/
(cd .scratch/old && bash perf/h200_serve_slice.sh --tag old "${levels[@]}")
bash perf/h200_serve_slice.sh --tag head1 "${levels[@]}"
bash perf/h200_serve_slice.sh --tag ahead --serve-arg --launch-ahead "${levels[@]}"
bash perf/h200_serve_slice.sh --tag head2 "${levels[@]}"
rm -f $OUT/*serve.log.gz
