#!/bin/bash
# For the next session (not run: the device budget ran out): the W4A16 MoE alone before and
# after the gathered permute (5eee409), on one machine: HEAD, 74eb2f5's m3serve (scattered
# permute), HEAD again; 128 experts at T 1, 8, 32 and prefill 2048, 8 experts at a C 64 step's
# shapes. Needs `.scratch/base` = 74eb2f5's m3serve (`mkdir -p .scratch/base && git archive
# 74eb2f5 m3serve | tar x -C .scratch/base`); carry `.whl` and `.scratch`. ~4 min.
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
. perf/device_env.sh > /dev/null
for tree in head base head2; do
  root=$PWD; [ $tree = base ] && root=$PWD/.scratch/base
  PYTHONPATH=/tmp/site:$root timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 \
    --prefill 2048 --no-grouped --out /tmp/$tree.json > $OUT/moe128_$tree.txt 2>&1
  echo "$tree e128 rc=$? at $(($(date +%s) - t0)) s"
  grep -E "^ +[0-9]+ |prefill T|dense" $OUT/moe128_$tree.txt
  PYTHONPATH=/tmp/site:$root timeout 90 python3 perf/bench_nvfp4_moe.py --tokens 64 --prefill 360 \
    --experts 8 --no-grouped --out /tmp/${tree}8.json > $OUT/moe8_$tree.txt 2>&1
  echo "$tree e8 rc=$?"; grep -E "^ +[0-9]+ |prefill T|dense" $OUT/moe8_$tree.txt
done
echo "done at $(($(date +%s) - t0)) s"
