#!/bin/bash
# Stop 49, call 1: the NVFP4 MoE's prefill with blocks of 256 pairs (one decode of an expert's
# weights for up to 288 pairs, where blocks of 128 decode them twice past 160): (1) the kernel
# against the plan at the slice's 8 experts (mixed steps of 272-640 tokens: 136-320 pairs an
# expert); (2) the 4-layer slice served by HEAD, then by HEAD with blocks of 256 past a mean of
# 128 pairs (`.scratch/p256`: HEAD's m3serve, perf and pyproject.toml with that plan), at C 16,
# 64, 128; (3) the kernel at the model's 128 experts (2048, 8192 tokens), if the call has time.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
v=default,pairs256,pairs256_no_tail
timeout 120 python3 perf/bench_nvfp4_moe.py --tokens '' --prefill 272,414,640 --experts 8 \
  --no-grouped --prefill-ablations --variants $v --out /tmp/moe_e8.json > $OUT/moe_e8.txt 2>&1
echo "e8 rc=$? at $(($(date +%s) - t0)) s"; grep -E "prefill T|default|pairs256|Error" $OUT/moe_e8.txt | head -20
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile|start-up" | sort -u | tail -12; }
levels=(c16:16:192 c64:64:256:probe c128:128:256)
timeout $(left 330) bash perf/h200_serve_slice.sh --tag head "${levels[@]}" > /tmp/h.out 2>&1
echo "== head rc=$? at $(($(date +%s) - t0)) s"; show /tmp/h.out
ln -sfn "$PWD/.whl" .scratch/p256/.whl
mkdir -p .scratch/p256/.scratch && ln -sf "$PWD"/.scratch/tcache.tgz.part* .scratch/p256/.scratch/
(cd .scratch/p256 && timeout $(left 540) bash perf/h200_serve_slice.sh --tag p256 "${levels[@]}") > /tmp/p.out 2>&1
echo "== p256 rc=$? at $(($(date +%s) - t0)) s"; show /tmp/p.out
rm -f $OUT/*serve.log.gz
if [ $(left 560) -gt 60 ]; then
  timeout $(left 575) python3 perf/bench_nvfp4_moe.py --tokens '' --prefill 2048,8192 \
    --no-grouped --prefill-ablations --variants $v --out /tmp/moe_e128.json > $OUT/moe_e128.txt 2>&1
  echo "e128 rc=$?"; grep -E "prefill T|default|pairs256|Error|dense" $OUT/moe_e128.txt | head -12
fi
echo "done at $(($(date +%s) - t0)) s"
