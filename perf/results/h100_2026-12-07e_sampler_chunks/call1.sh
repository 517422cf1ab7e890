#!/bin/bash
# Session 57, call 1 (carry .whl, .scratch/s57): on an H200, issue 10's layer table; on an H100,
# the probes (select radix/warps, sampling at 200K vocab, align CHUNK at prefill, parts rounds).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"
. perf/device_env.sh
if [[ $gpu == *H200* ]]; then
  bash perf/h200_layer_table.sh
  return_triton_cache
  exit 0
fi
step select 120 python3 .scratch/s57/select_sweep.py
cat $OUT/select.txt
step sample 120 python3 .scratch/s57/sample_sweep.py
cat $OUT/sample.txt
step parts 200 python3 perf/bench_moe_layer_parts.py --batches 1 8 --rounds 5 \
  --variants served no_moe --out $OUT/parts.json
tail -12 $OUT/parts.txt
step chunk 200 python3 .scratch/s57/chunk_ab.py
tail -40 $OUT/chunk.txt
return_triton_cache
