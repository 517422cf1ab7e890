#!/bin/bash
# Stop 50, call 3 (on an H200, while warm): issue 11's serving table at HEAD, then the
# W4A16 MoE alone at T 1 and 32 and a 2K-token prefill (issue 10), if the call has time.
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
left() { echo $(($1 - $(date +%s) + t0)); }
show() { grep -v "^2026" "$1" | grep -E "ready|^concurrency [0-9]+ |ideal|compile|start-up" | sort -u | tail -14; }
timeout $(left 430) bash perf/h200_serve_slice.sh --tag table > /tmp/t.out 2>&1
echo "== table rc=$? at $(($(date +%s) - t0)) s"; show /tmp/t.out
. perf/device_env.sh > /dev/null
if [ $(left 570) -gt 60 ]; then
  timeout $(left 575) python3 perf/bench_nvfp4_moe.py --tokens 1,32 --prefill 2048 --no-grouped \
    --out /tmp/moe.json > $OUT/moe.txt 2>&1
  echo "moe rc=$?"; grep -E "^ +[0-9]+ |prefill|dense|bandwidth" $OUT/moe.txt
fi
echo "done at $(($(date +%s) - t0)) s"; ls $OUT
