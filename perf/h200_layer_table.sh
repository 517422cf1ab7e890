#!/usr/bin/env bash
# Issue 10's table on a lent H200, in one device call (run from the repo root there): the GPU
# tests of the quantized kernels, one MoE layer's decode (bench_moe_layer.py with transformers,
# and bench_moe_layer_parts.py: what each part costs, one layer's kernel timeline), and the
# W4A16 MoE alone. What comes back under $OUT: tests.txt, then a .json and a .txt per bench
# (seven files; the device tool returns eight).
#
#   carry [".whl"] (plus ".scratch" holding tcache.tgz, a Triton cache, if any):
#   bash perf/h200_layer_table.sh [--ablations]
#
# `--ablations` runs the W4A16 MoE's tile, K-split and route variants too (bench_nvfp4_moe.py
# --ablations: a minute or two more).
#
# About 3.5 minutes with a warm Triton cache; each step has its own time limit, so a slow one
# costs its own output, not the others'.
set -u
ablations=()
[ "${1:-}" = --ablations ] && ablations=(--ablations)
. perf/device_env.sh

step() {  # step NAME SECONDS COMMAND...: run with a limit, say how it went and how long it took
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? after $(($(date +%s) - t0)) s"
}

step tests 240 python3 -m pytest -q tests/gpu/test_mxfp8_linear_gpu.py \
  tests/gpu/test_nvfp4_moe_gpu.py tests/gpu/test_hopper_quantized.py tests/gpu/test_router_gpu.py
tail -2 "$OUT/tests.txt"
step parts 180 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 --kernels served no_pdl \
  --out "$OUT/parts.json"
grep -A10 "read bandwidth" "$OUT/parts.txt"
step moe_layer 150 python3 perf/bench_moe_layer.py --out "$OUT/moe_layer.json"
tail -7 "$OUT/moe_layer.txt"
step nvfp4_moe 240 python3 perf/bench_nvfp4_moe.py --no-grouped "${ablations[@]}" \
  --out "$OUT/nvfp4_moe.json"
tail -15 "$OUT/nvfp4_moe.txt"
