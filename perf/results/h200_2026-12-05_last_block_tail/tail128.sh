#!/bin/bash
# Next session, one call (carry [".whl"]): the prefill tail at blocks of 128 pairs (T 3072 and
# 4096 at 128 experts: mean 96 and 128 pairs an expert), tail 0/16/32 with and without the cap.
. perf/device_env.sh
cat > /tmp/tail128.py <<'PY'
import torch
from bench_nvfp4_moe import ALPHA, LIMIT, TOP_K, H, INTER, dense_bf16_us, random_experts, steps
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe
ex = random_experts()
dense_tf = 2.0 * 8192 * 3 * H * INTER / dense_bf16_us(8192) / 1e6
print(f"dense bf16 {dense_tf:.1f} TFLOP/s")
for tokens in (3072, 4096):
    fl = 2.0 * tokens * TOP_K * 3 * H * INTER
    group = steps(tokens, 2, seed=tokens)
    for tail, cap in ((0, 0), (16, 0), (16, 128), (32, 0), (32, 128), (16, 168)):
        cfg = NVFP4MoEConfig(tail_m=tail, max_registers=cap)
        calls = [lambda s=s, c=cfg: nvfp4_moe(s.x, s.weights, s.ids, *ex.args(), ALPHA, LIMIT, config=c) for s in group]
        us = graph_us(calls, 100)
        print(f"T {tokens} tail {tail:2d} cap {cap:3d}: {us:8.1f} µs {fl / us / 1e6:6.1f} TFLOP/s {100 * fl / us / 1e6 / dense_tf:5.1f} %")
PY
PYTHONPATH=$PWD/perf:$PYTHONPATH timeout 400 python3 /tmp/tail128.py 2>&1 | grep -v Warn | tail -16
