#!/bin/bash
# Stop 51, call 2: MXFP8 decode tiles with idle rows (M 17-63 on a 32/64-row tile): HEAD (idle
# rows re-read row M - 1), masked (working tree), wrap (rows 0.. again); then the GPU tests.
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
. perf/device_env.sh > /dev/null
ms=17,24,33,40,48,56,64,80,100,128
for tree in base mask wrap base2 mask2; do
  case $tree in base*) root=.scratch/base ;; mask*) root=$PWD ;; wrap) root=.scratch/wrap ;; esac
  PYTHONPATH=/tmp/site:$root:$PWD/perf timeout 120 python3 .scratch/rows_ab.py $tree $ms \
    > $OUT/rows_$tree.txt 2>&1
  echo "$tree rc=$? at $(($(date +%s) - t0)) s"; grep "four projections" $OUT/rows_$tree.txt
done
timeout 240 python3 -m pytest -q -x tests/gpu -k "mxfp8" -p no:cacheprovider > $OUT/tests.txt 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests.txt
echo "done at $(($(date +%s) - t0)) s"
