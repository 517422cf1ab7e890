"""The NVFP4 MoE prefill at tails and register caps across T, random top-4 routing, CUDA-graph
timed: `tails.py call2` the tails of call 2 (then every block took one), `tails.py call3` the
plan (tail -1, cap -1) against no tail (call 3, tails in an expert's last block). Run with
perf/ on PYTHONPATH."""
import sys

import torch
from bench_nvfp4_moe import ALPHA, DEV, INTER, LIMIT, TOP_K, H, Step, dense_bf16_us, random_experts, steps
from gpu_timing import graph_us

from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe
from m3serve.kernels.triton.nvfp4_moe.plan import plan_moe

CASES = {  # (experts, tokens, [(tail_m, max_registers), ...])
    "call2": [(128, 512, [(0, 0), (16, 0)]), (128, 2048, [(16, 128), (32, 0), (32, 168)]),
              (128, 6144, [(0, 0), (16, 0), (32, 0)]), (128, 8192, [(0, 0), (32, 0)]),
              (8, 256, [(0, 0), (16, 0), (32, 0)]), (8, 512, [(0, 0), (32, 0)]),
              (8, 1184, [(0, 0), (16, 0), (32, 0)])],
    "call3": [(128, t, [(-1, -1), (0, 0)]) for t in (256, 512, 1024, 2048, 3072, 4096, 6144, 8192)]
    + [(8, t, [(-1, -1), (0, 0)]) for t in (256, 512, 1184)],
}


def few_steps(tokens, experts, count, seed):
    """Random top-4 of `experts` (the bench's `steps` routes over all 128)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(tokens, H, generator=gen, device=DEV).to(torch.bfloat16)
        w, ids = torch.topk(torch.rand(tokens, experts, generator=gen, device=DEV), TOP_K, dim=-1)
        out.append(Step(x, (w / w.sum(-1, keepdim=True) * 2.0).float(), ids.to(torch.int32)))
    return out


ex = random_experts()
dense_tf = 2.0 * 8192 * 3 * H * INTER / dense_bf16_us(8192) / 1e6
print(f"dense bf16 {dense_tf:.1f} TFLOP/s", flush=True)
for experts, tokens, variants in CASES[sys.argv[1]]:
    args = [t[:experts] for t in ex.args()]
    group = steps(tokens, 2, seed=tokens) if experts == 128 else few_steps(tokens, experts, 2, tokens)
    fl = 2.0 * tokens * TOP_K * 3 * H * INTER
    plan = plan_moe(tokens * TOP_K, experts, "auto")
    for tail, cap in variants:
        cfg = NVFP4MoEConfig(tail_m=tail, max_registers=cap)
        calls = [lambda s=s, c=cfg: nvfp4_moe(s.x, s.weights, s.ids, *args, ALPHA, LIMIT, config=c) for s in group]
        us = graph_us(calls, 100)
        print(f"E {experts:3d} T {tokens:5d} block {plan.block_m:3d} tail {tail:2d} cap {cap:3d}: "
              f"{us:8.1f} µs {fl / us / 1e6:6.1f} TFLOP/s {100 * fl / us / 1e6 / dense_tf:5.1f} %", flush=True)
