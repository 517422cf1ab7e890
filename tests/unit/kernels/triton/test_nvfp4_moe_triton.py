"""Triton NVFP4 fused MoE (m3serve.kernels.triton.nvfp4_moe) against the torch reference.

Tiny shapes (E 4..8, H 64, I 32..64, k 2) so the file runs in seconds under TRITON_INTERPRET=1
on the CPU; real shapes live in tests/gpu/test_nvfp4_moe_gpu.py. The reference is `moe_experts`
in fp32 on weights dequantized by `m3serve.kernels.quant`. With fp32 activations every product
in the kernel is exact and only fp32 summation order differs, so the tolerance is fp32 rounding;
bf16 activations add the rounding of the output to bf16 (which the interpreter truncates).

The sorted route's metadata and the decode helpers (the PTX nibble decode, the activations' K
order) have their own files: test_nvfp4_moe_align_triton.py, test_nvfp4_moe_decode_triton.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE, ON_GPU

from m3serve.kernels.moe import local_expert_ids, moe_experts
from m3serve.kernels.nvfp4_tiles import tile_experts
from m3serve.kernels.quant import dequant_nvfp4, quant_nvfp4
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe
from m3serve.kernels.triton.nvfp4_moe import plan as planning

H = 64
ALPHA = 1.702
LIMIT = 7.0
TOP_K = 2
ROUTES = ["slots", "sorted"]


class Experts:
    """NVFP4 experts in the checkpoint layout, built from random fp32 weights by quant_nvfp4."""

    def __init__(
        self, num_experts: int, inter: int, seed: int, scale: float = 0.08, hidden: int = H
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.inter = num_experts, inter
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * scale
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) * scale
        parts = [self._quant_w13(w13[e]) for e in range(num_experts)]
        self.w13 = torch.stack([p[0] for p in parts])
        self.w13_scale = torch.stack([p[1] for p in parts])
        self.w13_global = torch.stack([p[2] for p in parts])
        down = [quant_nvfp4(w2[e]) for e in range(num_experts)]
        self.w2 = torch.stack([d[0] for d in down])
        self.w2_scale = torch.stack([d[1] for d in down])
        self.w2_global = torch.stack([d[2] for d in down])

    def _quant_w13(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # w1 and w3 get their own globals, so a kernel that mixes up the halves is caught.
        gate, up = quant_nvfp4(w[: self.inter]), quant_nvfp4(w[self.inter :])
        return (
            torch.cat([gate[0], up[0]]),
            torch.cat([gate[1], up[1]]),
            torch.stack([gate[2], up[2]]),
        )

    def args(self) -> tuple[torch.Tensor, ...]:
        """The kernel's inputs: the same values, rows tiled as the hopper backend holds them."""
        w13, w13_scale, w2, w2_scale = tile_experts(
            self.w13, self.w13_scale, self.w2, self.w2_scale
        )
        tensors = (w13, w13_scale, self.w13_global, w2, w2_scale, self.w2_global)
        return tuple(t.to(DEVICE) for t in tensors)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.inter
        w13 = torch.stack(
            [
                torch.cat(
                    [
                        dequant_nvfp4(
                            self.w13[e, :i], self.w13_scale[e, :i], self.w13_global[e, 0]
                        ),
                        dequant_nvfp4(
                            self.w13[e, i:], self.w13_scale[e, i:], self.w13_global[e, 1]
                        ),
                    ]
                )
                for e in range(self.num_experts)
            ]
        )
        w2 = torch.stack(
            [
                dequant_nvfp4(self.w2[e], self.w2_scale[e], self.w2_global[e])
                for e in range(self.num_experts)
            ]
        )
        return w13, w2


def routing(
    tokens: int, num_experts: int, seed: int, ids_dtype: torch.dtype = torch.int32
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True) * 2.0, ids.to(ids_dtype)


def reference(
    ex: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float = LIMIT
) -> torch.Tensor:
    w13, w2 = ex.dequantized()
    return moe_experts(x.float().cpu(), weights.cpu(), ids.long().cpu(), w13, w2, ALPHA, limit)


def run(
    ex: Experts,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    route: str = "auto",
    limit: float = LIMIT,
    skips: bool = False,
    **tiles: int,
) -> torch.Tensor:
    out = nvfp4_moe(
        x.to(DEVICE),
        weights.to(DEVICE),
        ids.to(DEVICE),
        *ex.args(),
        ALPHA,
        limit,
        skips=skips,
        config=NVFP4MoEConfig(route=route, **tiles),
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    return out.cpu()


def activations(
    tokens: int, seed: int, dtype: torch.dtype = torch.float32, hidden: int = H
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # bf16-representable values: the GPU rounds fp32 activations to bf16 for the MMA.
    return (torch.randn(tokens, hidden, generator=gen) * 2.0).to(torch.bfloat16).to(dtype)


def assert_exact(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 kernel output vs the fp32 reference: summation order is the only difference."""
    scale = ref.abs().max().clamp(min=1e-6)
    err = ((got.float() - ref).abs().max() / scale).item()
    assert err < 2e-6 or (ON_GPU and err < 1e-2), f"max error {err:.3g} of the output scale"


# ------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_matches_reference(tokens: int, route: str) -> None:
    ex = Experts(num_experts=6, inter=32, seed=tokens)
    x = activations(tokens, seed=100 + tokens)
    weights, ids = routing(tokens, 6, seed=200 + tokens)
    assert_exact(run(ex, x, weights, ids, route), reference(ex, x, weights, ids))


@pytest.mark.parametrize("k_tiles", [1, 2, 4])
@pytest.mark.parametrize("route", ROUTES)
def test_several_k_tiles_per_row(route: str, k_tiles: int) -> None:
    """H 512 and I 256: two 128-wide K tiles per row group for down, four for gate_up, which the
    K loop walks one, two or four at a time (four: down's two, as many as divide both)."""
    ex = Experts(num_experts=3, inter=256, seed=17, hidden=512)
    x = activations(5, seed=18, hidden=512)
    weights, ids = routing(5, 3, seed=19)
    got = run(ex, x, weights, ids, route, k_tiles=k_tiles)
    assert_exact(got, reference(ex, x, weights, ids))


@pytest.mark.parametrize(("split_k", "k_tiles"), [(2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("route", ROUTES)
def test_k_split_over_programs(route: str, split_k: int, k_tiles: int) -> None:
    """Each projection's K over 2 or 4 programs (4 becomes 2 for down, whose K has 2 tiles):
    gate_up's partial pre-activations summed by the reduce kernel before SwiGLU, down's partial
    rows summed by the combine; with EP's skipped pairs too."""
    ex = Experts(num_experts=4, inter=256, seed=27, hidden=512)
    x = activations(5, seed=28, hidden=512)
    weights, ids = routing(5, 4, seed=29)
    got = run(ex, x, weights, ids, route, k_tiles=k_tiles, split_k=split_k)
    assert_exact(got, reference(ex, x, weights, ids))
    local = local_expert_ids(ids.long(), 2, 2)  # this rank holds experts 2 and 3
    got = run(ex, x, weights, local.to(ids.dtype), route, skips=True, split_k=split_k)
    assert_exact(got, reference(ex, x, weights, local))


@pytest.mark.parametrize("block_n", [32, 128, 256])
@pytest.mark.parametrize("route", ROUTES)
def test_weight_tiles_of_other_widths(route: str, block_n: int) -> None:
    """32 weight rows a program (16 gate and 16 up: below a warpgroup, the bench's mma.sync
    ablation); 128 (the plan's tiles from two tokens on), 64 gate and 64 up; and 256 (128 of
    each: four warpgroups sharing one activation tile), past down's 128 rows."""
    ex = Experts(num_experts=3, inter=128, seed=21, hidden=128)
    x = activations(4, seed=22, hidden=128)
    weights, ids = routing(4, 3, seed=23)
    got = run(ex, x, weights, ids, route, block_n=block_n)
    assert_exact(got, reference(ex, x, weights, ids))


def test_plan_tiles_by_pairs() -> None:
    """One token: narrow tiles, two K tiles a step; more decode pairs: wide tiles."""
    one = planning.plan_moe(4, 128, "auto")
    assert (one.route, one.gate_up_n, one.k_tiles) == (planning.ROUTE_SLOTS, 64, 2)
    eight = planning.plan_moe(32, 128, "auto")
    assert (eight.route, eight.gate_up_n, eight.k_tiles) == (planning.ROUTE_SLOTS, 128, 1)
    sorted_small = planning.plan_moe(256, 128, "auto")
    assert sorted_small.route == planning.ROUTE_SORTED
    assert (sorted_small.block_m, sorted_small.gate_up_n, sorted_small.tail_m) == (16, 128, 16)


def test_plan_gives_prefill_blocks_a_tail() -> None:
    """Blocks of 16 and 32 pairs take a 16-pair tail; of 64 too, under a register cap that keeps
    two 8-warp programs on an SM; of 128 a 32-pair one."""
    t512 = planning.plan_moe(2048, 128, "auto")
    assert (t512.block_m, t512.tail_m, t512.max_registers) == (16, 16, 0)
    t1024 = planning.plan_moe(4096, 128, "auto")
    assert (t1024.block_m, t1024.tail_m, t1024.max_registers) == (32, 16, 0)
    t2048 = planning.plan_moe(8192, 128, "auto")
    assert (t2048.block_m, t2048.tail_m, t2048.max_registers, t2048.num_warps) == (64, 16, 128, 8)
    t4096 = planning.plan_moe(16384, 128, "auto")
    assert (t4096.block_m, t4096.tail_m, t4096.max_registers) == (128, 32, 0)
    no_tail = planning.overridden(t2048, NVFP4MoEConfig(tail_m=0, max_registers=0))
    assert (no_tail.tail_m, no_tail.max_registers) == (0, 0)
    slots = planning.overridden(planning.plan_moe(4, 128, "auto"), NVFP4MoEConfig(tail_m=16))
    assert slots.tail_m == 0  # the slots route has no blocks


@pytest.mark.parametrize("route", ROUTES)
def test_bf16_activations_within_output_rounding(route: str) -> None:
    ex = Experts(num_experts=8, inter=64, seed=7)
    x = activations(5, seed=8, dtype=torch.bfloat16)
    weights, ids = routing(5, 8, seed=9, ids_dtype=torch.int64)
    got, ref = run(ex, x, weights, ids, route).float(), reference(ex, x, weights, ids)
    if ON_GPU:  # the activation between the projections is bf16 there
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
        return
    # One bf16 ulp of each output: the interpreter truncates the final cast.
    assert ((got - ref).abs() <= ref.abs() * 2.0**-7 + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize("route", ROUTES)
def test_shared_experts_unused_expert_and_more_pairs_than_a_block(route: str) -> None:
    """20 tokens all pick expert 0 (20 pairs: more than one 16-pair block) and one of experts
    1-2; expert 3 is used by no token, and the slot order differs from the token order."""
    ex = Experts(num_experts=4, inter=32, seed=11)
    x = activations(20, seed=12)
    second = torch.tensor([1, 2] * 10)
    ids = torch.stack([torch.zeros(20, dtype=torch.long), second], 1)
    ids[::3] = ids[::3].flip(1)  # expert 0 sometimes in slot 1
    weights = torch.rand(20, TOP_K, generator=torch.Generator().manual_seed(13))
    assert_exact(run(ex, x, weights, ids, route), reference(ex, x, weights, ids))


@pytest.mark.parametrize("route", ROUTES)
def test_many_pairs_per_expert(route: str) -> None:
    """65 pairs per expert on average: sorted takes BLOCK_M 128 and the 128-row tiles of the
    prefill plan; slots loops over five 16-pair chunks per expert."""
    ex = Experts(num_experts=4, inter=64, seed=14)
    x = activations(130, seed=15)
    weights, ids = routing(130, 4, seed=16)
    plan = planning.plan_moe(260, 4, route)
    if route == "sorted":
        assert plan.block_m == 128 and plan.gate_up_n == 128 and plan.num_warps == 8
    assert_exact(run(ex, x, weights, ids, route), reference(ex, x, weights, ids))


def test_blocks_of_128_pairs_on_64_weight_rows() -> None:
    """The bench's block_m128_n64_w4_s2: blocks of 128 pairs (and the 32-pair tail) against
    64-row weight tiles, one warpgroup, two stages."""
    ex = Experts(num_experts=4, inter=64, seed=17)
    x = activations(130, seed=18)
    weights, ids = routing(130, 4, seed=19)
    got = run(ex, x, weights, ids, "sorted", block_m=128, block_n=64, num_warps=4, num_stages=2)
    assert_exact(got, reference(ex, x, weights, ids))


@pytest.mark.parametrize("tail_m", [0, 32])
def test_blocks_of_256_pairs(tail_m: int) -> None:
    """Sorted blocks of 256 pairs (one decode of an expert's weights for all of them): 3
    experts over 400 tokens (top-2) give ~267 pairs each, some past 256 (a second block, or
    the tail)."""
    ex = Experts(num_experts=3, inter=64, seed=41, hidden=128)
    x = activations(400, seed=42, hidden=128)
    weights, ids = routing(400, 3, seed=43)
    assert torch.bincount(ids.flatten(), minlength=3).max() > 256
    got = run(ex, x, weights, ids, "sorted", block_m=256, tail_m=tail_m, num_stages=2)
    assert_exact(got, reference(ex, x, weights, ids))


@pytest.mark.parametrize("split_k", [1, 2])
def test_a_block_takes_the_pairs_of_its_tail_with_the_same_weights(split_k: int) -> None:
    """Sorted blocks of 16 pairs and a 16-pair tail: expert 0 has 20 pairs (a tail of 4),
    expert 1 40 (a block without a tail, then one of 16 and a tail of 8), experts 2 and 3 10
    each (no tail); the tail's own epilogue (SwiGLU, the top-k weight) and a K split too."""
    ex = Experts(num_experts=4, inter=256, seed=31, hidden=256)
    firsts = [0] * 20 + [1] * 10 + [1] * 10
    seconds = [1] * 20 + [2] * 10 + [3] * 10
    ids = torch.tensor([firsts, seconds]).t().contiguous()
    ids[1::3] = ids[1::3].flip(1)
    assert torch.bincount(ids.flatten(), minlength=4).tolist() == [20, 40, 10, 10]
    x = activations(40, seed=32, hidden=256)
    weights = torch.rand(40, TOP_K, generator=torch.Generator().manual_seed(33)) + 0.1
    got = run(ex, x, weights, ids, "sorted", block_m=16, tail_m=16, split_k=split_k)
    assert_exact(got, reference(ex, x, weights, ids))


@pytest.mark.parametrize("route", ROUTES)
def test_pairs_of_experts_held_elsewhere_are_skipped(route: str) -> None:
    """Expert parallelism: `local_expert_ids` marks experts other ranks hold with id E. Those
    pairs add nothing (the reference skips them too), also for a token with no held expert."""
    ex = Experts(num_experts=4, inter=32, seed=21)
    x = activations(7, seed=22)
    weights, ids = routing(7, 8, seed=23)  # 8 global experts, this rank holds 4..7
    local = local_expert_ids(ids.long(), 4, 4)
    local[0] = 4  # token 0: both of its experts elsewhere
    assert (local == 4).any() and (local < 4).any()
    got = run(ex, x, weights, local.to(ids.dtype), route, skips=True)
    assert_exact(got, reference(ex, x, weights, local))
    assert torch.equal(got[0], torch.zeros(H))


def test_edge_scales() -> None:
    """Zero groups, e4m3 scales at 448 and at the subnormal 2^-9, -0 codes, and w1/w3 globals
    three orders of magnitude apart."""
    ex = Experts(num_experts=4, inter=32, seed=17)
    e4m3 = torch.float8_e4m3fn
    ex.w13_scale[0, :, 0] = torch.tensor(0.0).to(e4m3)  # a zero group in every row
    ex.w13_scale[1, :8] = torch.tensor(448.0).to(e4m3)
    ex.w13_scale[1, 32:40] = torch.tensor(2.0**-9).to(e4m3)
    ex.w2_scale[2, :, 1] = torch.tensor(2.0**-9).to(e4m3)
    ex.w2_scale[3, 5] = torch.tensor(448.0).to(e4m3)
    ex.w13[2, :4] = 0x88  # -0 in both nibbles
    ex.w13_global[:, 0] *= 1e-3
    ex.w13_global[:, 1] *= 5.0
    ex.w2_global[1] = 1e-4
    x = activations(6, seed=18)
    weights, ids = routing(6, 4, seed=19)
    for route in ROUTES:
        assert_exact(run(ex, x, weights, ids, route), reference(ex, x, weights, ids))


# Very negative gates overflow exp() inside the interpreter's sigmoid: 1 / (1 + inf) is the 0 it
# should be.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_swiglu_clamp_engaged() -> None:
    """Pre-activations far beyond the limit on both sides: the clamps decide the result."""
    ex = Experts(num_experts=4, inter=32, seed=20, scale=1.5)
    x = activations(4, seed=21)
    weights, ids = routing(4, 4, seed=22)
    limit = 2.0
    w13, _ = ex.dequantized()
    pre = torch.einsum("th,eih->tei", x, w13)
    gate, up = pre[..., :32], pre[..., 32:]
    assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()
    got = run(ex, x, weights, ids, limit=limit)
    assert_exact(got, reference(ex, x, weights, ids, limit=limit))
    # The same clamps in the reduce kernel's epilogue (K split over two programs).
    assert_exact(run(ex, x, weights, ids, limit=limit, split_k=2), got)
    unclamped = reference(ex, x, weights, ids, limit=1e4)
    assert not torch.allclose(got, unclamped, rtol=1e-2)


def test_repeated_calls_are_bitwise_identical() -> None:
    ex = Experts(num_experts=4, inter=32, seed=23)
    x = activations(3, seed=24)
    weights, ids = routing(3, 4, seed=25)
    assert torch.equal(run(ex, x, weights, ids), run(ex, x, weights, ids))


def test_no_tokens() -> None:
    ex = Experts(num_experts=4, inter=32, seed=26)
    x = torch.empty(0, H, device=DEVICE)
    ids = torch.empty(0, TOP_K, dtype=torch.int32, device=DEVICE)
    out = nvfp4_moe(x, ids.float(), ids, *ex.args(), ALPHA, LIMIT)
    assert out.shape == (0, H)


def test_rejects_bad_inputs() -> None:
    ex = Experts(num_experts=4, inter=32, seed=27)
    x = activations(2, seed=28).to(DEVICE)
    weights, ids = routing(2, 4, seed=29)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    args = list(ex.args())
    with pytest.raises(ValueError, match="x must be"):
        nvfp4_moe(x.half(), weights, ids, *args, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="w13_scale"):
        bad = [*args]
        bad[1] = bad[1][..., :2]
        nvfp4_moe(x, weights, ids, *bad, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="row-tiled"):
        bad = [*args]
        bad[0] = ex.w13.to(DEVICE)  # the checkpoint's row-major layout
        nvfp4_moe(x, weights, ids, *bad, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="topk_ids"):
        nvfp4_moe(x, weights, ids[:1], *args, ALPHA, LIMIT)
