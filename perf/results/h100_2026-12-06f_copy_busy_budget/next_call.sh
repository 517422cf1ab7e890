#!/bin/bash
# For the next session (not yet run; ~3 min on a warm machine): why the copy read from 65 rows
# failed its GPU test in call 3, and the copy against the decode tiles at 16-64 rows.
# Before: `mkdir -p .scratch/v65 && git archive 1101516 m3serve perf pyproject.toml tests |
# tar x -C .scratch/v65`; carry `.whl`, `.scratch` (with tcache.tgz.part* if any) and this script.
nvidia-smi --query-gpu=name --format=csv,noheader
. perf/device_env.sh > /dev/null
# The failing test with its token lists (pytest -vv prints the differing items), on 1101516.
(cd .scratch/v65 && timeout 120 python3 -m pytest -x -vv tests/gpu/test_hopper_quantized.py \
  -k bf16_copy > $OUT/v65_test.txt 2>&1; tail -40 $OUT/v65_test.txt | grep -E "assert|Error|passed|failed|At index|\+|-" | head -30)
timeout 200 python3 perf/bench_mxfp8_linear.py --ms '' --prefill-m 0 --crossover-ms '' \
  --shapes qkv_index,o_proj,shared_gate_up,shared_down --mid-sweep --mid-ms 16,32,48,64,80 \
  > $OUT/mid_small.txt 2>&1; grep -E "served|differs" $OUT/mid_small.txt
