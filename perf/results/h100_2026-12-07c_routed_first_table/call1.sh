#!/usr/bin/env bash
# Stop 55 call 1: on an H200, issue 10's MoE numbers; on an H100, the host-chain question
# (wake.py, then the slice served with py-spy during C 1).
set -u
. perf/device_env.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"; nproc; lscpu | grep -i "model name"
python3 .scratch/s55/wake.py > "$OUT/wake.txt" 2>&1; cat "$OUT/wake.txt"
case $gpu in
  *H200*)
    step nvfp4_t1 200 python3 perf/bench_nvfp4_moe.py --tokens 1,8,32 --prefill 2048 --no-grouped \
      --ablations --ablation-tokens 1,8 --out "$OUT/nvfp4_t1.json" \
      --variants default,stages4,stages4_r128,rows64_k1,rows64_k1_s4,rows64_k1_s5,rows64_k1_s6
    tail -30 "$OUT/nvfp4_t1.txt"
    step parts 130 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
      --kernels served routed_first --out "$OUT/parts.json"
    grep -A10 "read bandwidth" "$OUT/parts.txt"
    step moe_layer 120 python3 perf/bench_moe_layer.py --out "$OUT/moe_layer.json"
    tail -7 "$OUT/moe_layer.txt"
    (cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
    ;;
  *)
    step parts 130 python3 perf/bench_moe_layer_parts.py --batches 1 8 64 \
      --kernels served routed_first --out "$OUT/parts.json"
    grep -A10 "read bandwidth" "$OUT/parts.txt"
    (cd "$OUT" && tar czf json.tgz ./*.json && rm -f ./*.json)
    timeout 300 bash perf/h200_serve_slice.sh --py-spy c1 c1:1:24 c64:64:256:probe
    ;;
esac
