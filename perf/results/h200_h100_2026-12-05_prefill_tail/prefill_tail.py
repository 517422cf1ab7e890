"""The NVFP4 MoE prefill with block tails: random top-4 routing (bench_nvfp4_moe's) and uniform
(every expert the same count), at T 2048 (BLOCK_M 64) and 1024 (BLOCK_M 32), one run."""

import torch
from bench_nvfp4_moe import ALPHA, E, H, INTER, LIMIT, TOP_K, dense_bf16_us, random_experts, steps
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe

DEV = torch.device("cuda")
ex = random_experts()
dense = dense_bf16_us(8192)
print(f"dense bf16 (8192 pairs): {dense:.1f} µs")
VARIANTS = {
    "tail 0": dict(tail_m=0, max_registers=0),
    "tail 16": dict(tail_m=16, max_registers=0),
    "tail 16 cap 128": dict(tail_m=16, max_registers=128),
    "tail 32 cap 128": dict(tail_m=32, max_registers=128),
    "tail 0 cap 128": dict(tail_m=0, max_registers=128),
}
for tokens in (2048, 1024):
    fl = 2.0 * tokens * TOP_K * 3 * H * INTER
    group = steps(tokens, 2, seed=tokens)
    t = torch.arange(tokens, device=DEV)[:, None] * TOP_K + torch.arange(TOP_K, device=DEV)
    uni = (t % E).to(torch.int32)
    counts = torch.bincount(group[0].ids.flatten(), minlength=E)
    print(
        f"T {tokens}: pairs an expert min {counts.min().item()} mean {counts.float().mean().item():.1f} max {counts.max().item()}"
    )
    for name, kw in VARIANTS.items():
        cfg = NVFP4MoEConfig(**kw)
        us = graph_us(
            [
                lambda s=s, cfg=cfg: nvfp4_moe(
                    s.x, s.weights, s.ids, *ex.args(), ALPHA, LIMIT, config=cfg
                )
                for s in group
            ],
            100,
        )
        uus = graph_us(
            [
                lambda cfg=cfg: nvfp4_moe(
                    group[0].x, group[0].weights, uni, *ex.args(), ALPHA, LIMIT, config=cfg
                )
            ],
            100,
        )
        ref = fl * 8192 / (2.0 * tokens * TOP_K)
        print(
            f"  {name:<16} random {us:8.1f} µs {fl / us / 1e6:6.1f} TFLOP/s ({100 * dense * fl / (2.0 * 8192 * 3 * H * INTER) / us:5.1f} % of dense) | uniform {uus:8.1f} µs {fl / uus / 1e6:6.1f}"
        )
