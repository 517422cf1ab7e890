"""Gemma-style RMSNorm: normalize in fp32, scale by (1 + w), cast back once at the end."""

from __future__ import annotations

import torch


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Multiply in fp32 before the cast (not x.to(dtype) * w): the checkpoint was trained that way.
    return (xf * (1.0 + weight.float())).to(x.dtype)


def add_gemma_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` then normalize it; returns (normed, new residual).

    A None residual means x is the first input of the stack and becomes the residual itself.
    """
    residual = x if residual is None else residual + x
    return gemma_rms_norm(residual, weight, eps), residual
