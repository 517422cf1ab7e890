#!/bin/bash
# Stop 50, call 1: the bf16 copy read from 65 rows (HEAD since 850dc10) against 129 rows
# (`.scratch/c129` = d8dba86's m3serve, perf, pyproject.toml and tests/gpu, made before the
# call with `git archive`): the fixed GPU test of the copy on both and the copy's graph-replay
# test, then the slice served by each at C 128 (its decode batches of 65-128 rows are where the
# two differ). Carry `.whl`, `.scratch` (with tcache.tgz.part*) and this directory.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
timeout 80 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1
timeout 80 python3 -m pytest -q tests/gpu/test_mxfp8_linear_gpu.py -k graph_replay 2>&1 | tail -1
(cd .scratch/c129 && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q \
  tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1)
echo "tests done at $(($(date +%s) - t0)) s"
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |compile" | sort -u | tail -8; }
timeout $(left 180) bash perf/h200_serve_slice.sh --tag c65 c128:128:256 > /tmp/h.out 2>&1
echo "== c65 (HEAD) rc=$? at $(($(date +%s) - t0)) s"; show /tmp/h.out
ln -sfn "$PWD/.whl" .scratch/c129/.whl
mkdir -p .scratch/c129/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/c129/.scratch/
(cd .scratch/c129 && timeout $(left 290) bash perf/h200_serve_slice.sh --tag c129 c128:128:256) > /tmp/c.out 2>&1
echo "== c129 rc=$? at $(($(date +%s) - t0)) s"; show /tmp/c.out
echo "done at $(($(date +%s) - t0)) s"; ls $OUT
