#!/bin/bash
# Stop 52, the last try (~200 s of device budget left): `rg` (the working tree) against `prev`
# (617d886, `.scratch/prev`), the W4A16 MoE alone at 128 experts, T 1 and a 2048-token
# prefill, then rg again. Carry `.whl`, `.scratch`, this directory.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
. perf/device_env.sh > /dev/null
for tree in rg prev rg2; do
  [ $(($(date +%s) - t0)) -gt 130 ] && { echo "skip $tree (time)"; continue; }
  root=$PWD; [ $tree = prev ] && root=$PWD/.scratch/prev
  PYTHONPATH=/tmp/site:$root timeout 70 python3 perf/bench_nvfp4_moe.py --tokens 1 \
    --prefill 2048 --no-grouped --out /tmp/$tree.json > $OUT/moe128_$tree.txt 2>&1
  echo "$tree rc=$? at $(($(date +%s) - t0)) s"
  grep -E "^ +[0-9]+ |prefill T|dense" $OUT/moe128_$tree.txt
done
echo "done at $(($(date +%s) - t0)) s"
