#!/bin/bash
# Stop 49, call 2: the bf16 copy read from 65 rows (`.scratch/c65`: HEAD with c22ca69 reverted,
# and its GPU test's assertion fixed: since 1101516 it compared a token list with the
# (tokens, info) pair engine_outputs returns, so it failed whatever the tokens); the fixed test
# on HEAD (129 rows) and on c65; the copy against the MMA tiles at 32-128 rows; the slice served
# by HEAD, then by c65, at C 16 and 128 (C 128's decode batches of 65-128 rows are where the two
# differ).
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
timeout 100 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1
(cd .scratch/c65 && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m pytest -q \
  tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1)
echo "tests done at $(($(date +%s) - t0)) s"
timeout 90 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 32,48,64,80,96,128 \
  > $OUT/mid.txt 2>&1; echo "mid rc=$? at $(($(date +%s) - t0)) s"
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |compile" | sort -u | tail -8; }
levels=(c16:16:192 c128:128:256)
timeout $(left 350) bash perf/h200_serve_slice.sh --tag head "${levels[@]}" > /tmp/h.out 2>&1
echo "== head rc=$? at $(($(date +%s) - t0)) s"; show /tmp/h.out
ln -sfn "$PWD/.whl" .scratch/c65/.whl
mkdir -p .scratch/c65/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/c65/.scratch/
(cd .scratch/c65 && timeout $(left 540) bash perf/h200_serve_slice.sh --tag c65 "${levels[@]}") > /tmp/c.out 2>&1
echo "== c65 rc=$? at $(($(date +%s) - t0)) s"; show /tmp/c.out
rm -f $OUT/*serve.log.gz $OUT/tcache*
echo "done at $(($(date +%s) - t0)) s"
