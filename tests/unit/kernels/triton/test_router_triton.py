"""Triton MoE router (m3serve.kernels.triton.router) against the torch reference `route_topk`.

Tiny shapes (E 8 and 16, H 64, k 2 and 4) so the file runs in seconds under TRITON_INTERPRET=1
on the CPU; real shapes live in tests/gpu/test_router_gpu.py. Every kernel path is covered: the
GEMV route (the default up to 8 tokens: a program per expert, the last to finish selects),
fused (the default above, at these sizes) and split, where partial logits over hidden chunks
and/or expert blocks go through scratch and a second kernel sums them and selects. Ties are
built from small dyadic numbers, so every logit is exact whatever the summation order and equal
biased scores are really equal.
"""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.kernels.moe import route_topk
from m3serve.kernels.triton import router
from m3serve.kernels.triton.router import BLOCK_K, GEMV_MAX_TOKENS, route, route_plan

H = 64
SCALE = 2.0
# Kernel vs torch: the same fp32 products summed in another order, then sigmoid and the
# renormalization, each a few ulps of values of order one (on the GPU Triton's exp is the
# ex2-based approximation, a few ulps more than torch's).
RTOL = 4e-6
# The launch plans exercised: the default (fused here) and the split paths.
PLANS = {
    "default": {},
    "h-split": {"splits": 2},
    "h-split-16": {"splits": 2, "block_t": 16},
}


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def inputs(
    t: int, e: int, seed: int, hidden: int = H, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit-RMS activations, a weight giving logits of order one, a bias of order the score gaps."""
    x = randn(t, hidden, seed=seed).to(dtype)
    w = randn(e, hidden, seed=seed + 1, scale=hidden**-0.5)
    b = randn(e, seed=seed + 2, scale=0.1)
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


def assert_matches_reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, **plan: int
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = route(x, w, b, k, SCALE, **plan)
    assert weights.shape == ids.shape == (x.shape[0], k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    ref_w, ref_ids = route_topk(x, w, b, k)
    got_w, got_ids = by_id(weights, ids)
    ref_w, ref_ids = by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids), f"ids {got_ids.tolist()} vs {ref_ids.tolist()}"
    torch.testing.assert_close(got_w, ref_w * SCALE, rtol=RTOL, atol=0.0)
    # Returned in descending order of the biased score.
    biased = (torch.sigmoid(x.float() @ w.t()) + b).gather(1, ids)
    assert (biased[:, 1:] <= biased[:, :-1] + RTOL).all()
    return weights, ids


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize(("e", "k"), [(8, 2), (16, 4)])
def test_matches_route_topk(t: int, e: int, k: int) -> None:
    x, w, b = inputs(t, e, seed=10 * t + e)
    assert_matches_reference(x, w, b, k)


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_split_paths_match_route_topk(plan: dict[str, int]) -> None:
    x, w, b = inputs(33, 16, seed=3, dtype=torch.bfloat16)
    assert_matches_reference(x, w, b, 4, **plan)


def test_expert_blocks_and_ragged_hidden() -> None:
    # 32 experts in two blocks of 16, and H = 40: the last split holds a partial BLOCK_K step.
    x, w, b = inputs(5, 32, seed=4, hidden=40)
    assert_matches_reference(x, w, b, 4)  # the GEMV route's last hidden step is partial
    assert_matches_reference(x, w, b, 4, expert_blocks=2)
    assert_matches_reference(x, w, b, 4, expert_blocks=2, splits=2)


@pytest.mark.parametrize("t", [1, 2, 3, GEMV_MAX_TOKENS])
def test_the_gemv_route_agrees_with_the_tile_route_call_after_call(t: int) -> None:
    assert route_plan(t, 16, H, torch.device("cpu")).gemv
    x, w, b = inputs(t, 16, seed=20 + t, dtype=torch.bfloat16)
    tile_w, tile_ids = route(x, w, b, 4, SCALE, splits=1)
    # The arrival count goes back to zero after each call: the next call selects again.
    for _ in range(3):
        gemv_w, gemv_ids = assert_matches_reference(x, w, b, 4)
        assert torch.equal(gemv_ids, tile_ids)
        torch.testing.assert_close(gemv_w, tile_w, rtol=RTOL, atol=0.0)
    assert not route_plan(GEMV_MAX_TOKENS + 1, 16, H, torch.device("cpu")).gemv


def test_paths_agree_and_repeat_bit_for_bit() -> None:
    x, w, b = inputs(33, 16, seed=5, dtype=torch.bfloat16)
    fused_w, fused_ids = route(x, w, b, 4, SCALE)
    split_w, split_ids = route(x, w, b, 4, SCALE, splits=2)
    assert torch.equal(fused_ids, split_ids)  # same order too: no near-ties in this data
    torch.testing.assert_close(split_w, fused_w, rtol=RTOL, atol=0.0)
    again_w, again_ids = route(x, w, b, 4, SCALE, splits=2)
    assert torch.equal(again_w, split_w) and torch.equal(again_ids, split_ids)


def dyadic(*shape: int, seed: int, denom: int, span: int) -> torch.Tensor:
    """Integers in [-span, span] / denom: products and their sums over H stay exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-span, span + 1, shape, generator=g).float() / denom


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_exact_ties_go_to_the_lowest_id(plan: dict[str, int]) -> None:
    e, t = 16, 5
    x = dyadic(t, H, seed=6, denom=8, span=16)
    w = dyadic(e, H, seed=7, denom=64, span=64) / 8
    # Experts 11 and 4 tie for first place; 14, 5, 12 and 9 tie for the last two slots; the
    # rest are out of reach. Tied experts share their weight row and bias, so their logits are
    # the same number.
    b = torch.full((e,), -2.0)
    w[11] = w[4].clone()
    b[[4, 11]] = 1.0
    w[[14, 5, 12]] = w[9].clone()
    b[[14, 5, 12, 9]] = 0.5
    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    weights, ids = route(x, w, b, 4, SCALE, **plan)
    assert ids.tolist() == [[4, 11, 5, 9]] * t
    scores = torch.sigmoid(x @ w.t()).gather(1, ids)
    torch.testing.assert_close(
        weights, scores / scores.sum(1, keepdim=True) * SCALE, rtol=RTOL, atol=0
    )
    assert torch.equal(weights[:, 0], weights[:, 1]) and torch.equal(weights[:, 2], weights[:, 3])


def test_all_experts_tied() -> None:
    x = dyadic(3, H, seed=8, denom=8, span=16).to(DEVICE)
    w = dyadic(1, H, seed=9, denom=64, span=64).expand(8, H).contiguous().to(DEVICE)
    weights, ids = route(x, w, torch.zeros(8, device=DEVICE), 4, SCALE)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    assert torch.equal(weights, torch.full_like(weights, SCALE / 4))


def test_large_bias_picks_winners_but_not_weights() -> None:
    e, k = 16, 4
    x, w, b = inputs(33, e, seed=11)
    scores = torch.sigmoid(x @ w.t())
    # Boost the four experts with the lowest mean score: the bias alone decides every token.
    boosted = scores.mean(0).argsort()[:k]
    b = b.clone()
    b[boosted] += 10.0
    weights, ids = assert_matches_reference(x, w, b, k)
    expected = boosted.sort().values.expand(x.shape[0], k)
    assert torch.equal(ids.sort(1).values, expected)
    plain_ids = route(x, w, b - b, k, SCALE)[1]
    assert not torch.equal(plain_ids.sort(1).values, expected), "the bias changed nothing"
    # The weights are the unbiased scores of the winners, renormalized and scaled.
    mine = scores.gather(1, ids)
    torch.testing.assert_close(weights, mine / mine.sum(1, keepdim=True) * SCALE, rtol=RTOL, atol=0)


def test_nan_activations_still_give_distinct_valid_ids() -> None:
    x, w, b = inputs(3, 16, seed=12)
    x[1, 7] = float("nan")
    _, ids = route(x, w, b, 4, SCALE)
    assert ((ids >= 0) & (ids < 16)).all()
    assert (ids.sort(1).values.diff(dim=1) > 0).all()


def test_no_tokens() -> None:
    x, w, b = inputs(0, 8, seed=13)
    weights, ids = route(x, w, b, 2, SCALE)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 9}, "top_k"),
        ({"weight": torch.zeros(8, H, dtype=torch.bfloat16)}, "float32"),
        ({"bias": torch.zeros(7)}, "bias shape"),
        ({"x": torch.zeros(2, H + 1)}, "want"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"x": torch.zeros(2, H), "weight": torch.zeros(8, H), "bias": torch.zeros(8)}
    args["top_k"] = 2
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        route(scale=SCALE, **args)


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """A CUDA device of 132 SMs as far as route_plan can tell (it asks only for the count)."""
    monkeypatch.setattr(router, "sm_count", lambda index: 132)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("t", [1, 3, 8, 32, 64, 128, 257, 2048, 4096, 8192])
def test_plan_on_the_real_shapes(h200: torch.device, t: int) -> None:
    hidden, e = 6144, 128
    plan = route_plan(t, e, hidden, h200)
    assert plan.chunk % BLOCK_K == 0
    assert (plan.splits - 1) * plan.chunk < hidden <= plan.splits * plan.chunk
    assert plan.block_e * plan.expert_blocks == e
    if plan.gemv:  # decode: one program per expert, every token in one block
        assert t <= GEMV_MAX_TOKENS and plan.programs == e and plan.block_t >= t
        return
    tiles = -(-t // plan.block_t)
    if plan.fused:  # only when the token tiles alone nearly fill the GPU
        assert t >= 8192 and tiles * 4 >= 3 * 132
    else:  # split until the grid has about two programs per SM
        assert 132 <= tiles * plan.programs <= 4 * 132
    if t == 32:
        # Verify and short prefill: the 3 MB weight over 256 programs of 32 experts x 96 columns.
        assert (plan.block_t, plan.splits, plan.expert_blocks) == (32, 64, 4)
