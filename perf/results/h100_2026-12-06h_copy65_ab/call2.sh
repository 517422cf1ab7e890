#!/bin/bash
# Stop 50, call 2 (run first: machines were scarce): the W4A16 MoE with one dot per weight
# tile (the decoded even and odd halves joined into one [rows, 128] operand against the
# activations loaded as one tile, so a K step has one warpgroup wait where it had four):
# `.scratch/catD` (tiles of 16 pairs without a tail only) and `.scratch/catE` (every tile,
# prefill too), each HEAD with its own nvfp4_moe/decode.py (catD.patch, catE.patch), against
# HEAD: the bench in the order HEAD, D, E, HEAD, then the kernel's GPU tests on E's tree.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
bench() {  # bench TREE TAG [ARG...]
  local tree=$1 tag=$2
  shift 2
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout $(left 540) python3 perf/bench_nvfp4_moe.py \
    --tokens 1,2,4,8,32 --prefill 2048 --no-grouped --out /tmp/moe_$tag.json "$@") \
    > $OUT/moe_$tag.txt 2>&1
  echo "== $tag rc=$? at $(($(date +%s) - t0)) s"
  grep -E "^ +[0-9]+ |of dense|T=" $OUT/moe_$tag.txt
}
# HEAD also with the 32-row (mma.sync) ablations at T 1, 8, 32.
bench . head --ablations --variants default,rows32_w2_k2,rows32_w4_k2
bench .scratch/catD D
bench .scratch/catE E
[ $(left 420) -gt 60 ] && bench . head2
# E's tree holds D's decode path too (tiles of 16 pairs without a tail), so its tests cover both.
(cd .scratch/catE && PYTHONPATH=/tmp/site:$PWD:$PWD/perf timeout $(left 580) python3 -m pytest \
  -q -p no:cacheprovider tests/gpu/test_nvfp4_moe_gpu.py > $OUT/tests_E.txt 2>&1)
echo "tests E rc=$?: $(tail -1 $OUT/tests_E.txt)"
echo "done at $(($(date +%s) - t0)) s"; ls $OUT
