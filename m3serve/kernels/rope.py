"""Partial NeoX-style rotary embedding: only the first `rotary_dim` channels of a head rotate,
paired (i, i + rotary_dim/2) inside that slice; the rest pass through."""

from __future__ import annotations

import torch


def rope_inv_freq(
    rotary_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return (1.0 / (theta**exponents)).to(device)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin of shape [T, rotary_dim], both halves repeated (rotate_half layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any float dtype, computed in x's dtype); cos/sin: [T, rotary_dim]."""
    rot = cos.shape[-1]
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
