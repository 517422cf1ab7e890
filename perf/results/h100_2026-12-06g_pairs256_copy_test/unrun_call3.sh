#!/bin/bash
# Stop 49, call 3 (call2.sh trimmed to the device time left: its machine never started): the
# fixed GPU test of the bf16 copy on HEAD (129 rows) and on `.scratch/c65` (HEAD with c22ca69
# reverted: the copy read from 65 rows), then the slice served by each at C 128, whose decode
# batches of 65-128 rows are where the two differ.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
timeout 80 python3 -m pytest -q tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1
(cd .scratch/c65 && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q \
  tests/gpu/test_hopper_quantized.py -k bf16_copy 2>&1 | tail -1)
echo "tests done at $(($(date +%s) - t0)) s"
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |compile" | sort -u | tail -8; }
timeout $(left 175) bash perf/h200_serve_slice.sh --tag head c128:128:256 > /tmp/h.out 2>&1
echo "== head rc=$? at $(($(date +%s) - t0)) s"; show /tmp/h.out
ln -sfn "$PWD/.whl" .scratch/c65/.whl
mkdir -p .scratch/c65/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/c65/.scratch/
(cd .scratch/c65 && timeout $(left 280) bash perf/h200_serve_slice.sh --tag c65 c128:128:256) > /tmp/c.out 2>&1
echo "== c65 rc=$? at $(($(date +%s) - t0)) s"; show /tmp/c.out
rm -f $OUT/*serve.log.gz $OUT/tcache*
echo "done at $(($(date +%s) - t0)) s"
