#!/usr/bin/env bash
# Issue 10's table on a lent H200, in one device call (run from the repo root there): the GPU
# tests of the quantized kernels, one MoE layer's decode (bench_moe_layer.py with transformers,
# and bench_moe_layer_parts.py: what each part costs, one layer's kernel timeline), and the
# W4A16 MoE alone. What comes back under $OUT: tests.txt, a .txt per bench, and json.tgz with
# each bench's .json (the device tool returns at most eight files).
#
#   carry [".whl"] (plus ".scratch" holding tcache.tgz.part*, a Triton cache, if any):
#   bash perf/h200_layer_table.sh [--ablations]
#
# `--ablations` runs the W4A16 MoE's pipeline-depth, tile and PDL variants too
# (bench_nvfp4_moe.py --ablations --variants, below), and the W8A16 MXFP8 decode tiles with
# their scales loaded as bytes and as words (bench_mxfp8_linear.py --decode-sweep, two shapes)
# beside the served tiles at M 24-128: about four minutes more, within the device tool's ten.
#
# About 3.5 minutes with a warm Triton cache; each step has its own time limit, so a slow one
# costs its own output, not the others'.
set -u
ablations=()
# The pipeline-depth rows for T = 1's bytes in flight, the served tiles' neighbours and PDL; the
# prefill's tail choices (all of `ABLATIONS` no longer fit the step's four minutes).
variants=default,no_pdl,stages4,stages4_r128,rows64_k1,rows64_k1_s4,rows64_k1_s5,rows64_k1_s6
variants+=,rows128_k1,no_tail,tail32
[ "${1:-}" = --ablations ] && ablations=(--ablations --variants "$variants")
. perf/device_env.sh

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
if [ ${#ablations[@]} -gt 0 ]; then
  step mxfp8 200 python3 perf/bench_mxfp8_linear.py --shapes qkv_index,o_proj --ms 24,96,128 \
    --prefill-m 0 --crossover-ms '' --decode-sweep --out "$OUT/mxfp8.json"
  head -20 "$OUT/mxfp8.txt"
fi
(cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
