"""SwiGLU-OAI, non-interleaved: gate is the first half of the fused gate_up projection."""

from __future__ import annotations

import torch


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    # Gate is clamped from above only, up on both sides (the +1 on up is the "beta" of the recipe).
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
