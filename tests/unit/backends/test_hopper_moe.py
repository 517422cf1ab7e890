"""The hopper backend's MoE under expert parallelism (on the GPU when there is one, else in
Triton's interpreter on the CPU): a rank holding a slice of the experts gives the reference
backend's partial sum for that slice, with NVFP4 experts (the fused Triton MoE, on row-tiled
experts as the hopper backend holds them; the reference reads them back in row order) and with
dense ones (the masked torch path)."""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE, ON_GPU

from m3serve.backends.hopper import HopperBackend
from m3serve.backends.reference import ReferenceBackend, dequant_experts
from m3serve.kernels.nvfp4_tiles import tile_experts
from m3serve.kernels.quant import quant_nvfp4
from m3serve.model.weights import DenseExperts, Nvfp4Experts

CPU = torch.device("cpu")
E, H, INTER, TOP_K = 8, 64, 32, 2
ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0


def nvfp4_experts(seed: int) -> Nvfp4Experts:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
    up = [quant_nvfp4(w13[e]) for e in range(E)]
    down = [quant_nvfp4(w2[e]) for e in range(E)]
    w13, w13_scale, w2, w2_scale = tile_experts(
        torch.stack([u[0] for u in up]),
        torch.stack([u[1] for u in up]),
        torch.stack([d[0] for d in down]),
        torch.stack([d[1] for d in down]),
    )
    w13_global = torch.stack([torch.stack([u[2], u[2]]) for u in up])
    w2_global = torch.stack([d[2] for d in down])
    return Nvfp4Experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global, tiled=True)


def held(
    experts: Nvfp4Experts | DenseExperts, first: int, count: int
) -> Nvfp4Experts | DenseExperts:
    fields = {
        k: v[first : first + count] if isinstance(v, torch.Tensor) else v
        for k, v in vars(experts).items()
    }
    return type(experts)(**fields)


@pytest.mark.parametrize("kind", ["nvfp4", "dense"])
def test_a_rank_holding_some_experts_gives_their_share_of_the_sum(kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=gen)
    router = torch.randn(E, H, generator=gen) * 0.3
    bias = torch.randn(E, generator=gen) * 0.1
    experts: Nvfp4Experts | DenseExperts = nvfp4_experts(seed=6)
    if kind == "dense":
        experts = dequant_experts(experts, torch.float32)
    hopper, reference = HopperBackend(DEVICE, interpreter=not ON_GPU), ReferenceBackend(CPU)
    args = (TOP_K, ALPHA, LIMIT, SCALE)
    whole = reference.moe(x, router, bias, experts, *args)
    halves = []
    for first in (0, E // 2):
        mine = held(experts, first, E // 2)
        on_device = type(mine)(
            **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in vars(mine).items()}
        )
        inputs = (t.to(DEVICE) for t in (x, router, bias))
        got = hopper.moe(*inputs, on_device, *args, first_expert=first).cpu()
        torch.testing.assert_close(
            got,
            reference.moe(x, router, bias, mine, *args, first_expert=first),
            rtol=1e-4,
            atol=1e-5,
        )
        halves.append(got)
    # The two ranks' partial sums add up to the whole layer (what the all-reduce does).
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-4, atol=1e-5)
