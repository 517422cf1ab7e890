"""Sigmoid + bias routing, the routed expert sum and SwiGLU-OAI against HF's MiniMaxM3VL modules."""

from __future__ import annotations

import math

import pytest
import torch

from m3serve.kernels.activation import swiglu_oai
from m3serve.kernels.moe import moe_experts, route_topk

ALPHA, LIMIT = 1.702, 7.0
HIDDEN, INTER, EXPERTS, TOP_K = 16, 12, 8, 2


def hf_text_config():  # -> MiniMaxM3VLTextConfig (imported lazily: transformers is slow to load)
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )

    return MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=INTER,
        dense_intermediate_size=INTER,
        shared_intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
        layer_types=["full_attention"],
        mlp_layer_types=["sparse"],
        bos_token_id=1,
        eos_token_id=2,
    )


def expert_weights(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] (gate rows first), w2 [E, H, I]; `scale` pushes activations past ±7."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * scale / math.sqrt(HIDDEN)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / math.sqrt(INTER)
    return w13, w2


def scalar_swiglu(gate: float, up: float) -> float:
    g = min(gate, LIMIT)
    u = max(-LIMIT, min(up, LIMIT))
    return (u + 1.0) * g / (1.0 + math.exp(-ALPHA * g))


# ------------------------------------------------------------------------------- routing


def test_bias_changes_selection_but_weights_are_unbiased_renormalized_sigmoid() -> None:
    # Identity router: logits are x itself. Expert 3 has the lowest score but a huge bias.
    logits = [2.0, 1.0, 0.0, -1.0]
    x = torch.tensor([logits])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = route_topk(x, torch.eye(4), bias, top_k=2)
    assert sorted(ids[0].tolist()) == [0, 3]
    s0, s3 = (1 / (1 + math.exp(-v)) for v in (logits[0], logits[3]))
    by_id = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert by_id[0] == pytest.approx(s0 / (s0 + s3), rel=1e-6)
    assert by_id[3] == pytest.approx(s3 / (s0 + s3), rel=1e-6)


def test_zero_bias_selects_highest_sigmoid_scores() -> None:
    x = torch.tensor([[0.5, -3.0, 4.0, 1.0, -0.2]])
    _, ids = route_topk(x, torch.eye(5), torch.zeros(5), top_k=3)
    assert sorted(ids[0].tolist()) == [0, 2, 3]


def test_routing_weights_are_fp32_and_sum_to_one_for_bf16_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, HIDDEN, generator=gen).bfloat16()
    router = torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16()
    weights, ids = route_topk(x, router, torch.randn(EXPERTS, generator=gen), TOP_K)
    assert weights.dtype == torch.float32
    assert weights.shape == ids.shape == (6, TOP_K)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    assert all(len(set(row)) == TOP_K for row in ids.tolist())


@torch.no_grad()
def test_route_topk_matches_hf_router_with_bias() -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLTopKRouter

    router = MiniMaxM3VLTopKRouter(hf_text_config())
    gen = torch.Generator().manual_seed(1)
    router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen))
    router.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=gen))
    x = torch.randn(64, HIDDEN, generator=gen)

    _, hf_weights, hf_ids = router(x)
    weights, ids = route_topk(x, router.weight, router.e_score_correction_bias, TOP_K)
    _, unbiased_ids = route_topk(x, router.weight, torch.zeros(EXPERTS), TOP_K)

    for t in range(x.shape[0]):
        ours = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        theirs = dict(zip(hf_ids[t].tolist(), hf_weights[t].tolist(), strict=True))
        assert ours.keys() == theirs.keys(), t
        for expert, weight in ours.items():
            assert weight == pytest.approx(theirs[expert], rel=1e-6, abs=1e-7)
    # The bias is big enough to matter: some tokens route differently without it.
    assert any(set(a) != set(b) for a, b in zip(ids.tolist(), unbiased_ids.tolist(), strict=True))


# ------------------------------------------------------------------------------- experts


def naive_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Per-token, per-slot float64 loop with scalar SwiGLU-OAI."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = w13[e].double() @ x[t].double()
            act = torch.tensor(
                [scalar_swiglu(float(g), float(u)) for g, u in zip(*gate_up.chunk(2), strict=True)],
                dtype=torch.float64,
            )
            out[t] += float(weights[t, slot]) * (w2[e].double() @ act)
    return out


def routed_inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    # Route onto a subset of experts so some experts receive no token at all.
    ids = torch.stack([torch.randperm(EXPERTS - 2, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return x, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("scale", [1.0, 12.0])
def test_moe_experts_equals_naive_per_token_loop(scale: float) -> None:
    x, weights, ids = routed_inputs(10, seed=2)
    w13, w2 = expert_weights(seed=3, scale=scale)
    got = moe_experts(x, weights, ids, w13, w2, ALPHA, LIMIT)
    expected = naive_moe(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-5)
    if scale > 1.0:  # the clamps really engaged
        pre = torch.einsum("eoh,th->teo", w13, x)
        assert (pre[..., :INTER] > LIMIT).any() and (pre[..., INTER:].abs() > LIMIT).any()


def test_moe_experts_expert_id_order_within_a_token_is_irrelevant() -> None:
    x, weights, ids = routed_inputs(7, seed=4)
    w13, w2 = expert_weights(seed=5)
    flipped = moe_experts(x, weights.flip(-1), ids.flip(-1), w13, w2, ALPHA, LIMIT)
    torch.testing.assert_close(flipped, moe_experts(x, weights, ids, w13, w2, ALPHA, LIMIT))


def test_moe_experts_single_token_single_expert_is_that_expert_scaled() -> None:
    x, _, _ = routed_inputs(1, seed=6)
    w13, w2 = expert_weights(seed=7)
    out = moe_experts(x, torch.tensor([[0.25]]), torch.tensor([[5]]), w13, w2, ALPHA, LIMIT)
    expected = 0.25 * (swiglu_oai(x @ w13[5].t(), ALPHA, LIMIT) @ w2[5].t())
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("scale", [1.0, 12.0])
@torch.no_grad()
def test_moe_experts_matches_hf_experts(scale: float) -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    experts = MiniMaxM3VLExperts(hf_text_config())
    w13, w2 = expert_weights(seed=8, scale=scale)
    experts.gate_up_proj.copy_(w13)  # HF's [E, 2I, H] layout is our w13 layout
    experts.down_proj.copy_(w2)
    x, weights, ids = routed_inputs(16, seed=9)
    torch.testing.assert_close(
        moe_experts(x, weights, ids, w13, w2, ALPHA, LIMIT), experts(x, ids, weights)
    )


@torch.no_grad()
def test_moe_experts_bf16_tracks_fp32_and_keeps_dtype() -> None:
    x, weights, ids = routed_inputs(8, seed=10)
    w13, w2 = expert_weights(seed=11)
    ref = moe_experts(x, weights, ids, w13, w2, ALPHA, LIMIT)
    out = moe_experts(x.bfloat16(), weights, ids, w13.bfloat16(), w2.bfloat16(), ALPHA, LIMIT)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------------------- activation


def test_swiglu_oai_hand_values_including_clamps() -> None:
    # Gate is clamped from above only; up on both sides; the +1 applies to the clamped up.
    pairs = [
        (0.5, 0.25),
        (10.0, 0.0),  # gate clamped to 7
        (-10.0, 2.0),  # gate below -7 is NOT clamped
        (1.0, 10.0),  # up clamped to 7
        (1.0, -10.0),  # up clamped to -7 -> (up + 1) = -6
        (7.0, -7.0),
        (-30.0, -30.0),
    ]
    gate = torch.tensor([g for g, _ in pairs], dtype=torch.float64)
    up = torch.tensor([u for _, u in pairs], dtype=torch.float64)
    got = swiglu_oai(torch.cat([gate, up]), ALPHA, LIMIT)
    expected = torch.tensor([scalar_swiglu(g, u) for g, u in pairs], dtype=torch.float64)
    torch.testing.assert_close(got, expected)
    assert got[2].item() == pytest.approx(3.0 * -10.0 / (1.0 + math.exp(17.02)))
    assert got[4].item() == pytest.approx(-6.0 * 1.0 / (1.0 + math.exp(-ALPHA)))


def test_swiglu_oai_splits_gate_then_up_along_last_dim() -> None:
    gate_up = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0, 0.0]])  # gate [1,2,3], up zeros
    got = swiglu_oai(gate_up, ALPHA, LIMIT)
    expected = torch.tensor([[scalar_swiglu(g, 0.0) for g in (1.0, 2.0, 3.0)]])
    torch.testing.assert_close(got, expected)


@torch.no_grad()
def test_swiglu_oai_matches_hf_gate_beyond_the_clamps() -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    gate_up = torch.randn(32, 2 * INTER, generator=torch.Generator().manual_seed(12)) * 12.0
    assert (gate_up[:, :INTER] < -LIMIT).any() and (gate_up[:, INTER:] > LIMIT).any()
    hf = MiniMaxM3VLExperts(hf_text_config())._apply_gate(gate_up)
    assert torch.equal(swiglu_oai(gate_up, ALPHA, LIMIT), hf)


@torch.no_grad()
def test_dense_mlp_with_swiglu_oai_matches_hf_dense_mlp() -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLDenseMLP

    mlp = MiniMaxM3VLDenseMLP(hf_text_config())
    gen = torch.Generator().manual_seed(13)
    mlp.gate_up_proj.weight.copy_(torch.randn(2 * INTER, HIDDEN, generator=gen))  # big: clamps
    mlp.down_proj.weight.copy_(torch.randn(HIDDEN, INTER, generator=gen) / math.sqrt(INTER))
    x = torch.randn(20, HIDDEN, generator=gen)
    gate_up = x @ mlp.gate_up_proj.weight.t()
    assert (gate_up[:, :INTER] < -LIMIT).any() and (gate_up[:, :INTER] > LIMIT).any()
    ours = swiglu_oai(gate_up, ALPHA, LIMIT) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(ours, mlp(x))
