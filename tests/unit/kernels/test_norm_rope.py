"""Gemma RMSNorm and partial NeoX RoPE against HF's MiniMaxM3VL building blocks."""

from __future__ import annotations

import math

import pytest
import torch

from m3serve.kernels.norm import add_gemma_rms_norm, gemma_rms_norm
from m3serve.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

EPS = 1e-6
THETA = 5_000_000.0


def hf_norm(weight: torch.Tensor) -> torch.nn.Module:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm

    norm = MiniMaxM3VLRMSNorm(weight.shape[0], eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def hf_rope_config(head_dim: int, partial: float):  # -> MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )

    return MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=2 * head_dim,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": THETA,
            "partial_rotary_factor": partial,
        },
        layer_types=["full_attention"],
        mlp_layer_types=["dense"],
        bos_token_id=1,
        eos_token_id=2,
    )


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------- norm


@torch.no_grad()
def test_gemma_rms_norm_fp32_is_bitwise_hf() -> None:
    weight = randn(32, seed=0, scale=0.5)
    x = randn(5, 3, 32, seed=1, scale=4.0)
    assert torch.equal(gemma_rms_norm(x, weight, EPS), hf_norm(weight)(x))


@torch.no_grad()
def test_gemma_rms_norm_bf16_matches_hf_and_keeps_dtype() -> None:
    weight = randn(64, seed=2, scale=0.5)
    x = randn(7, 64, seed=3, scale=10.0).bfloat16()
    out = gemma_rms_norm(x, weight.bfloat16(), EPS)
    hf = hf_norm(weight.bfloat16().float())(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, hf, rtol=1.6e-2, atol=1e-5)


def test_gemma_rms_norm_scales_by_one_plus_weight() -> None:
    x = torch.tensor([[3.0, -4.0]])  # rms = sqrt(12.5)
    weight = torch.tensor([0.0, 1.0])
    got = gemma_rms_norm(x, weight, 0.0)
    rms = math.sqrt(12.5)
    torch.testing.assert_close(got, torch.tensor([[3.0 / rms, 2 * -4.0 / rms]]))


def test_gemma_rms_norm_zero_weight_gives_unit_rms_rows() -> None:
    x = randn(6, 48, seed=4, scale=100.0)
    out = gemma_rms_norm(x, torch.zeros(48), EPS)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(6), rtol=1e-5, atol=1e-5)


def test_gemma_rms_norm_bf16_multiplies_in_fp32_before_the_single_cast() -> None:
    weight = randn(64, seed=5, scale=0.7).bfloat16()
    x = randn(9, 64, seed=6, scale=3.0).bfloat16()
    xf = x.float()
    once = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1 + weight.float())).to(
        torch.bfloat16
    )
    assert torch.equal(gemma_rms_norm(x, weight, EPS), once)


def test_add_gemma_rms_norm_without_residual_normalizes_x_and_returns_it_as_residual() -> None:
    weight = randn(16, seed=7, scale=0.3)
    x = randn(4, 16, seed=8)
    normed, residual = add_gemma_rms_norm(x, None, weight, EPS)
    assert torch.equal(residual, x)
    assert torch.equal(normed, gemma_rms_norm(x, weight, EPS))


def test_add_gemma_rms_norm_adds_then_normalizes_without_mutating_inputs() -> None:
    weight = randn(16, seed=9, scale=0.3)
    x, residual = randn(4, 16, seed=10), randn(4, 16, seed=11)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = add_gemma_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, x_before + residual_before)
    assert torch.equal(normed, gemma_rms_norm(x_before + residual_before, weight, EPS))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


# ---------------------------------------------------------------------------------- rope


@pytest.mark.parametrize(("head_dim", "partial"), [(16, 0.5), (128, 0.5), (16, 1.0)])
def test_rope_inv_freq_matches_hf_default_rope_parameters(head_dim: int, partial: float) -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLRotaryEmbedding,
    )

    cfg = hf_rope_config(head_dim, partial)
    hf_inv, _ = MiniMaxM3VLRotaryEmbedding.compute_default_rope_parameters(cfg)
    ours = rope_inv_freq(int(head_dim * partial), THETA)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, hf_inv)


def test_rope_inv_freq_formula() -> None:
    inv = rope_inv_freq(64, THETA)
    assert inv.shape == (32,)
    expected = torch.tensor([THETA ** (-2 * i / 64) for i in range(32)], dtype=torch.float32)
    torch.testing.assert_close(inv, expected, rtol=1e-6, atol=0.0)


@torch.no_grad()
def test_rope_cos_sin_matches_hf_rotary_embedding() -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLRotaryEmbedding,
    )

    cfg = hf_rope_config(16, 0.5)
    positions = torch.tensor([0, 1, 2, 17, 1000, 524_287])
    hf_cos, hf_sin = MiniMaxM3VLRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(8, THETA))
    assert cos.shape == sin.shape == (6, 8)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_apply_rope_partial_matches_hf_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    positions = torch.tensor([0, 3, 9, 250, 4097])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(8, THETA))
    q = randn(5, 4, 16, seed=12).to(dtype)
    k = randn(5, 2, 16, seed=13).to(dtype)
    # HF's layout [.., heads, T, D] with cos [T, rot] unsqueezed at dim 1 -> here [T, heads, D].
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=1)
    ours_q, ours_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert ours_q.dtype == dtype
    assert torch.equal(ours_q, hf_q) and torch.equal(ours_k, hf_k)


def test_apply_rope_channels_past_rotary_dim_pass_through_bitwise() -> None:
    x = randn(6, 3, 16, seed=14)
    cos, sin = rope_cos_sin(torch.arange(100, 106), rope_inv_freq(8, THETA))
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])


@pytest.mark.parametrize("channel", range(8))
def test_apply_rope_rotates_pairs_i_and_i_plus_half(channel: int) -> None:
    rot, half, pos = 8, 4, 37
    x = torch.zeros(1, 1, 12)
    x[0, 0, channel] = 1.0
    cos, sin = rope_cos_sin(torch.tensor([pos]), rope_inv_freq(rot, THETA))
    out = apply_rope(x, cos, sin)[0, 0]
    i = channel % half
    angle = pos * THETA ** (-2 * i / rot)
    partner = channel + half if channel < half else channel - half
    expected = torch.zeros(12)
    expected[channel] = math.cos(angle)
    # out_i = c_i cos - c_{i+half} sin ; out_{i+half} = c_{i+half} cos + c_i sin
    expected[partner] = math.sin(angle) if channel < half else -math.sin(angle)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_apply_rope_position_zero_is_identity() -> None:
    x = randn(1, 4, 16, seed=15)
    cos, sin = rope_cos_sin(torch.tensor([0]), rope_inv_freq(8, THETA))
    assert torch.equal(apply_rope(x, cos, sin), x)


def test_apply_rope_preserves_pair_norms_and_relative_position_dot_products() -> None:
    inv = rope_inv_freq(16, THETA)
    q, k = randn(1, 1, 16, seed=16), randn(1, 1, 16, seed=17)

    def rotated(x: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rope(x, *rope_cos_sin(torch.tensor([pos]), inv))[0, 0]

    def pair_norm(v: torch.Tensor) -> torch.Tensor:
        return v[:8] ** 2 + v[8:] ** 2

    torch.testing.assert_close(pair_norm(rotated(q, 123)), pair_norm(q[0, 0]))
    # <R(m) q, R(n) k> depends only on m - n.
    torch.testing.assert_close(
        rotated(q, 50) @ rotated(k, 20), rotated(q, 130) @ rotated(k, 100), rtol=1e-4, atol=1e-4
    )
