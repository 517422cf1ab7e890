#!/bin/bash
# For the next session (not run: no device time was left; ~4 min on a started machine): the
# bf16 copy read from 65 rows (HEAD since 850dc10) against 129 rows (`.scratch/c129`, made
# before the call: `mkdir -p .scratch/c129 && git archive d8dba86 m3serve perf pyproject.toml
# tests | tar x -C .scratch/c129 && rm -rf .scratch/c129/perf/results .scratch/c129/tests/unit
# .scratch/c129/tests/e2e`): the fixed GPU test of the copy on both, then the slice served by
# each at C 128, whose decode batches of 65-128 rows are where the two differ. Carry `.whl`,
# `.scratch` (with tcache.tgz.part*) and this directory.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
timeout 80 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1
# cuBLAS on the copy captured in CUDA graphs at 65 and 128 rows (added in stop 49, unrun).
timeout 80 python3 -m pytest -q tests/gpu/test_mxfp8_linear_gpu.py -k graph_replay 2>&1 | tail -1
(cd .scratch/c129 && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q \
  tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1)
echo "tests done at $(($(date +%s) - t0)) s"
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |compile" | sort -u | tail -8; }
timeout $(left 175) bash perf/h200_serve_slice.sh --tag c65 c128:128:256 > /tmp/h.out 2>&1
echo "== c65 (HEAD) rc=$? at $(($(date +%s) - t0)) s"; show /tmp/h.out
ln -sfn "$PWD/.whl" .scratch/c129/.whl
mkdir -p .scratch/c129/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/c129/.scratch/
(cd .scratch/c129 && timeout $(left 280) bash perf/h200_serve_slice.sh --tag c129 c128:128:256) > /tmp/c.out 2>&1
echo "== c129 rc=$? at $(($(date +%s) - t0)) s"; show /tmp/c.out
echo "done at $(($(date +%s) - t0)) s"
