#!/bin/bash
# Stop 52, call 1: the W4A16 MoE alone, trees on one machine: `rg` (the working tree: on the
# sorted route the gate_up epilogue stores act positions contiguously, its programs' weight
# rows gathered by `mma_k_source`; the slots route as before), `prev` (617d886,
# `.scratch/prev`), `base` (74eb2f5: the scattered permute too, `.scratch/base`), `rg` again,
# `ga` (`.scratch/ga`: gathered rows on both routes), and last `actn` (prev with the act store
# made contiguous, `cols = n`: wrong order, timing only). 128 experts at T 1, 8, 32 and a
# 2048-token prefill; 8 experts at a C 64 step's shapes (T 64, prefill 360). Then the GPU MoE
# tests on the working tree. Carry `.whl`, `.scratch`, this directory.
# `bash call1.sh [SECONDS]`: the call's own time cap (default 470; no tree starts past
# SECONDS - 140, the tests take what is left).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
cap=${1:-470}
. perf/device_env.sh > /dev/null
mkdir -p /tmp/actn && cp -r .scratch/prev/m3serve /tmp/actn/
sed -i 's/cols = mma_k_position(n, ACT_TILE_K)/cols = n/' /tmp/actn/m3serve/kernels/triton/nvfp4_moe/kernels.py
grep -c "cols = n$" /tmp/actn/m3serve/kernels/triton/nvfp4_moe/kernels.py
for tree in rg prev base rg2 ga actn; do
  [ $(($(date +%s) - t0)) -gt $((cap - 140)) ] && { echo "skip $tree (time)"; continue; }
  root=$PWD
  case $tree in prev|base|ga) root=$PWD/.scratch/$tree ;; actn) root=/tmp/actn ;; esac
  PYTHONPATH=/tmp/site:$root timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 \
    --prefill 2048 --no-grouped --out /tmp/$tree.json > /tmp/moe128_$tree.txt 2>&1
  echo "$tree e128 rc=$? at $(($(date +%s) - t0)) s"
  grep -E "^ +[0-9]+ |prefill T|dense" /tmp/moe128_$tree.txt
  PYTHONPATH=/tmp/site:$root timeout 60 python3 perf/bench_nvfp4_moe.py --tokens 64 --prefill 360 \
    --experts 8 --no-grouped --out /tmp/${tree}8.json > /tmp/moe8_$tree.txt 2>&1
  echo "$tree e8 rc=$?"; grep -E "^ +[0-9]+ |prefill T|dense" /tmp/moe8_$tree.txt
done
tar czf $OUT/moe.tgz -C /tmp $(cd /tmp && ls moe128_*.txt moe8_*.txt)
left=$((cap - $(date +%s) + t0))
[ $left -gt 60 ] && { timeout $left python3 -m pytest -q -x tests/gpu/test_nvfp4_moe_gpu.py > $OUT/tests_moe.txt 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests_moe.txt; }
echo "done at $(($(date +%s) - t0)) s"
