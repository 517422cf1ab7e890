#!/bin/bash
# Session 57, call 4: the slice served at C 1 and 16 with the chunked sampler (new), then with
# HEAD's sampler files (base; everything else the same); the served default samples T 1, top_p .95.
nvidia-smi --query-gpu=name --format=csv,noheader
bash perf/h200_serve_slice.sh --tag new c1:1:24 c16:16:192 > $OUT/new_console.txt 2>&1
tail -30 $OUT/new_console.txt | grep -v "^\s*$" | tail -22
cp .scratch/s57/base/m3serve/kernels/triton/sampling.py .scratch/s57/base/m3serve/kernels/triton/sampling_kernels.py m3serve/kernels/triton/
bash perf/h200_serve_slice.sh --tag base c1:1:24 c16:16:192 > $OUT/base_console.txt 2>&1
tail -30 $OUT/base_console.txt | grep -v "^\s*$" | tail -22
