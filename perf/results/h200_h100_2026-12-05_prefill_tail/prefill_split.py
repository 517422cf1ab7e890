"""How the served NVFP4 MoE prefill's time splits into weight decode and MMA: uniform routing
(every expert the same pair count c), block_m 64 or 128 (overrides), one run."""

import torch
from bench_nvfp4_moe import ALPHA, E, H, INTER, LIMIT, TOP_K, random_experts
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe

DEV = torch.device("cuda")
ex = random_experts()
gen = torch.Generator(device=DEV).manual_seed(3)
for c in (64, 96, 32):
    tokens = c * E // TOP_K
    x = torch.randn(tokens, H, generator=gen, device=DEV).to(torch.bfloat16)
    t = torch.arange(tokens, device=DEV)[:, None] * TOP_K + torch.arange(TOP_K, device=DEV)
    ids = (t % E).to(torch.int32)
    w = torch.full((tokens, TOP_K), 0.5, device=DEV)
    for bm in (0, 32, 64, 128):
        cfg = NVFP4MoEConfig(route="sorted", block_m=bm)
        us = graph_us(
            [lambda cfg=cfg: nvfp4_moe(x, w, ids, *ex.args(), ALPHA, LIMIT, config=cfg)], 100
        )
        fl = 2.0 * tokens * TOP_K * 3 * H * INTER
        print(f"c {c:3d} block_m {bm or 'plan':>4}: {us:8.1f} µs {fl / us / 1e6:6.1f} TFLOP/s")
