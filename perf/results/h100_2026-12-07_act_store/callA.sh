#!/bin/bash
# Stop 53, call A: a1502de (rg, the working tree) against 617d886 (prev) and rg again, the W4A16
# MoE alone at 128 experts (T 1, 8 and a 2048-token prefill), then the GPU MoE tests on rg.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
. perf/device_env.sh > /dev/null
for tree in rg prev rg2; do
  [ $(($(date +%s) - t0)) -gt 200 ] && { echo "skip $tree (time)"; continue; }
  root=$PWD; [ $tree = prev ] && root=$PWD/.scratch/prev
  PYTHONPATH=/tmp/site:$root timeout 90 python3 perf/bench_nvfp4_moe.py --tokens 1,8 \
    --prefill 2048 --no-grouped --out $OUT/$tree.json > $OUT/moe128_$tree.txt 2>&1
  echo "$tree rc=$? at $(($(date +%s) - t0)) s"
  grep -E "^ +[0-9]+ |prefill T|dense" $OUT/moe128_$tree.txt
done
left=$((450 - $(date +%s) + t0))
timeout $left python3 -m pytest -q -x tests/gpu/test_nvfp4_moe_gpu.py > $OUT/tests_moe.txt 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests_moe.txt
echo "done at $(($(date +%s) - t0)) s"
