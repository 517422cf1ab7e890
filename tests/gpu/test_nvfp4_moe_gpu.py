"""Triton NVFP4 fused MoE on the model's real shapes (E 128, H 6144, I 3072, top-4) on the GPU.

Weights are random valid NVFP4 drawn on the device: uniform codes (so -0, the subnormal 0.5 and
6 all occur), e4m3 group scales in [1/4, 2] with some groups zeroed, and different globals for
the w1 and w3 halves of each expert. Activations are unit-RMS; with the chosen scales the gate
and up pre-activations have an RMS of ~3, so SwiGLU-OAI's clamp at 7 is engaged.

The reference is fp32 (no TF32) on the weights dequantized by m3serve.kernels.quant, per
expert. Tolerance: relative error of each token's output <= 1e-2. The kernel rounds the
intermediate activation and the output to bf16 (2^-9 relative each), everything else is exact
products summed in fp32, so a decode or layout bug shows up orders of magnitude above it.

Also: the inline-PTX decode against the plain Triton one (bitwise, same tiles), the two
routes against each other, CUDA-graph capture and replay with new routing, determinism, and a
warm call with host syncs made errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from m3serve.kernels.activation import swiglu_oai
from m3serve.kernels.moe import local_expert_ids
from m3serve.kernels.nvfp4_tiles import tile_experts
from m3serve.kernels.quant import dequant_nvfp4
from m3serve.kernels.triton.nvfp4_moe import SLOTS_MAX_PAIRS, NVFP4MoEConfig, nvfp4_moe

DEV = torch.device("cuda")
E, H, INTER, TOP_K = 128, 6144, 3072, 4
ALPHA, LIMIT = 1.702, 7.0
TOL = 1e-2
# Reference rows for the 2048-token prefill: the fp32 reference on all of them takes ~20 s.
PREFILL_CHECK_ROWS = 256


@pytest.fixture(autouse=True)
def exact_fp32_matmul() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


@dataclass
class Experts:
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    tiled: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self) -> None:
        # The kernel's inputs: the same values with their rows tiled, as the backend holds them.
        w13, w13_scale, w2, w2_scale = tile_experts(
            self.w13, self.w13_scale, self.w2, self.w2_scale
        )
        self.tiled = (w13, w13_scale, self.w13_global, w2, w2_scale, self.w2_global)

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.tiled

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 w13 [2I, H] (each half with its own global) and w2 [H, I] of expert e."""
        gate = dequant_nvfp4(self.w13[e, :INTER], self.w13_scale[e, :INTER], self.w13_global[e, 0])
        up = dequant_nvfp4(self.w13[e, INTER:], self.w13_scale[e, INTER:], self.w13_global[e, 1])
        down = dequant_nvfp4(self.w2[e], self.w2_scale[e], self.w2_global[e])
        return torch.cat([gate, up]), down


def random_nvfp4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, device=DEV)
    scale = torch.rand(E, rows, cols // 16, generator=gen, device=DEV) * 1.75 + 0.25
    scale = torch.where(torch.rand(scale.shape, generator=gen, device=DEV) < 0.01, 0.0, scale)
    return codes.to(torch.uint8), scale.to(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def experts() -> Experts:
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13, w13_scale = random_nvfp4(2 * INTER, H, gen)
    w2, w2_scale = random_nvfp4(H, INTER, gen)
    # RMS of a uniform e2m1 code is ~2.9 and of the scales ~1.2: these globals give unit-RMS
    # inputs pre-activations of RMS ~3.4 (gate), ~2.6 (up) and outputs of order 1.
    spread = torch.rand(E, 2, generator=gen, device=DEV) + 0.5
    w13_global = spread * torch.tensor([0.012, 0.009], device=DEV)
    w2_global = (torch.rand(E, generator=gen, device=DEV) + 0.5) * 0.002
    return Experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global)


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-4 experts per token from random scores; weights renormalized, times 2."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(tokens, E, generator=gen, device=DEV)
    weights, ids = torch.topk(scores, TOP_K, dim=-1)
    return (weights / weights.sum(-1, keepdim=True) * 2.0).float(), ids.to(torch.int32)


def activations(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(tokens, H, generator=gen, device=DEV).to(torch.bfloat16)


def reference(
    ex: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """fp32 [len(rows), H] for the given token rows, one dequantized expert at a time."""
    xs, ws, idx = x[rows].float(), weights[rows], ids[rows].long()
    out = torch.zeros(xs.shape, device=DEV)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        w13, w2 = ex.dequantized(e)
        hidden = swiglu_oai(xs[tok] @ w13.t(), ALPHA, LIMIT)
        out.index_add_(0, tok, (hidden @ w2.t()) * ws[tok, slot, None])
    return out


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    err = (got.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-6)
    assert err.max().item() <= TOL, f"worst token: relative error {err.max().item():.3g}"


def run(
    ex: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **cfg: object
) -> torch.Tensor:
    return nvfp4_moe(x, weights, ids, *ex.args(), ALPHA, LIMIT, config=NVFP4MoEConfig(**cfg))


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 257])
def test_matches_reference(experts: Experts, tokens: int) -> None:
    x = activations(tokens, seed=tokens)
    weights, ids = routing(tokens, seed=1000 + tokens)
    got = run(experts, x, weights, ids)
    assert_close(got, reference(experts, x, weights, ids, torch.arange(tokens, device=DEV)))


@pytest.mark.parametrize(("tokens", "split_k"), [(1, 2), (1, 4), (8, 2), (64, 2)])
def test_k_split_over_programs(experts: Experts, tokens: int, split_k: int) -> None:
    x = activations(tokens, seed=tokens)
    weights, ids = routing(tokens, seed=1000 + tokens)
    got = run(experts, x, weights, ids, split_k=split_k)
    assert_close(got, reference(experts, x, weights, ids, torch.arange(tokens, device=DEV)))


def test_prefill_2048_tokens(experts: Experts) -> None:
    tokens = 2048
    x = activations(tokens, seed=1)
    weights, ids = routing(tokens, seed=2)
    got = run(experts, x, weights, ids)
    rows = torch.randperm(tokens, generator=torch.Generator().manual_seed(3))[:PREFILL_CHECK_ROWS]
    rows = rows.to(DEV)
    assert_close(got[rows], reference(experts, x, weights, ids, rows))


@pytest.mark.parametrize(("tail_m", "max_registers"), [(0, 0), (16, 0), (16, 128), (32, 128)])
def test_prefill_blocks_with_a_tail(experts: Experts, tail_m: int, max_registers: int) -> None:
    """2048 tokens (64 pairs an expert on average, BLOCK_M 64): experts with a few pairs more
    take them in their block's tail, with and without the register cap."""
    tokens = 2048
    x = activations(tokens, seed=4)
    weights, ids = routing(tokens, seed=5)
    got = run(experts, x, weights, ids, tail_m=tail_m, max_registers=max_registers)
    rows = torch.randperm(tokens, generator=torch.Generator().manual_seed(6))[:PREFILL_CHECK_ROWS]
    rows = rows.to(DEV)
    assert_close(got[rows], reference(experts, x, weights, ids, rows))


def test_clamp_is_engaged(experts: Experts) -> None:
    """The data really exercises SwiGLU-OAI's clamps (else the tests above would not see a bug
    in them)."""
    x = activations(16, seed=4).float()
    w13, _ = experts.dequantized(0)
    pre = x @ w13.t()
    assert (pre[:, :INTER] > LIMIT).any() and (pre[:, INTER:].abs() > LIMIT).any()


@pytest.mark.parametrize("tokens", [4, 2048])
def test_ptx_decode_equals_plain_triton_decode(experts: Experts, tokens: int) -> None:
    """Both decodes produce the same exact bf16 tiles, so the outputs should agree to the bit (the
    bound leaves room for a different MMA schedule); if the inline PTX is wrong on some device,
    this pinpoints it while the plain decode still matches the reference."""
    x = activations(tokens, seed=5)
    weights, ids = routing(tokens, seed=6)
    fast = run(experts, x, weights, ids, dequant="asm").float()
    plain = run(experts, x, weights, ids, dequant="triton").float()
    assert ((fast - plain).norm() / plain.norm()).item() < 1e-4


def test_routes_agree(experts: Experts) -> None:
    tokens = SLOTS_MAX_PAIRS // TOP_K
    x = activations(tokens, seed=7)
    weights, ids = routing(tokens, seed=8)
    slots = run(experts, x, weights, ids, route="slots").float()
    sorted_ = run(experts, x, weights, ids, route="sorted").float()
    assert ((slots - sorted_).norm() / sorted_.norm()).item() < 1e-3


def test_int64_ids_and_repeated_experts(experts: Experts) -> None:
    """Every token on the same four experts: one expert owns all pairs (several 16-pair chunks on
    the slots route, several blocks on the sorted one); int64 ids."""
    tokens = 40
    x = activations(tokens, seed=9)
    weights, _ = routing(tokens, seed=10)
    ids = torch.tensor([7, 3, 120, 64], device=DEV).repeat(tokens, 1)
    ids[::2] = ids[::2].flip(1)
    ref = reference(experts, x, weights, ids, torch.arange(tokens, device=DEV))
    for route in ("slots", "sorted"):
        assert_close(run(experts, x, weights, ids, route=route), ref)


@pytest.mark.parametrize("route", ["slots", "sorted"])
@pytest.mark.parametrize("tokens", [1, 8, 257])
def test_expert_parallel_rank_skips_the_pairs_it_does_not_hold(
    experts: Experts, tokens: int, route: str
) -> None:
    """One of two EP ranks: it holds experts 64..127 (a strided slice of the pool) and gets
    `local_expert_ids`; pairs routed to 0..63 add nothing, the rest match the reference."""
    if route == "slots" and tokens * TOP_K > SLOTS_MAX_PAIRS:
        pytest.skip("more pairs than the slots route takes")
    held = E // 2
    x = activations(tokens, seed=30 + tokens)
    weights, ids = routing(tokens, seed=40 + tokens)
    mine = [t[held:] for t in experts.args()]
    local = local_expert_ids(ids, held, held)
    got = nvfp4_moe(
        x, weights, local, *mine, ALPHA, LIMIT, skips=True,
        config=NVFP4MoEConfig(route=route),
    )  # fmt: skip
    # The reference over all experts with the other rank's pairs weighted 0.
    kept = torch.where(ids >= held, weights, 0.0)
    rows = torch.arange(tokens, device=DEV)
    ref = reference(experts, x, kept, ids, rows)
    has_local = (ids >= held).any(dim=1)
    assert torch.equal(got[~has_local].float(), torch.zeros_like(ref[~has_local]))
    assert_close(got[has_local], ref[has_local])


def test_repeated_calls_are_bitwise_identical(experts: Experts) -> None:
    x = activations(2048, seed=11)
    weights, ids = routing(2048, seed=12)
    assert torch.equal(run(experts, x, weights, ids), run(experts, x, weights, ids))


# --------------------------------------------------------------------------- capture, syncs


@pytest.mark.parametrize("tokens", [1, 8, 2048])
def test_cuda_graph_replay_with_new_routing(experts: Experts, tokens: int) -> None:
    """Captured once; each replay sees new activations, expert ids and weights in the same
    buffers and must give what an eager call gives."""
    x = activations(tokens, seed=13)
    weights, ids = routing(tokens, seed=14)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(experts, x, weights, ids)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(experts, x, weights, ids)
    for seed in (15, 16, 17):
        new_w, new_ids = routing(tokens, seed=seed)
        x.copy_(activations(tokens, seed=seed))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(experts, x, weights, ids))


@pytest.mark.parametrize("tokens", [8, 2048])
def test_warm_call_does_not_synchronize(experts: Experts, tokens: int) -> None:
    x = activations(tokens, seed=18)
    weights, ids = routing(tokens, seed=19)
    run(experts, x, weights, ids)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(experts, x, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
