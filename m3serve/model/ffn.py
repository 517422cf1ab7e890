"""Feed-forward blocks: the dense SwiGLU-OAI MLP and the routed MoE with one shared expert."""

from __future__ import annotations

import torch
from torch import nn

from m3serve.model.backend import Backend
from m3serve.model.config import TextConfig
from m3serve.model.params import Linear, weight


class DenseMLP(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        width: int,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        # gate_proj and up_proj of the checkpoint, fused: gate rows first.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, dtype, device)
        self.down_proj = Linear(width, cfg.hidden_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        gate_up = backend.linear(x, self.gate_up_proj.weight)
        hidden = backend.swiglu(gate_up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return backend.linear(hidden, self.down_proj.weight)


class Experts(nn.Module):
    """All routed experts of a layer, stacked: w13 [E, 2I, H] (w1 rows, then w3), w2 [E, H, I]."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.w13 = weight(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = weight(e, h, i, dtype=dtype, device=device)


class Router(nn.Module):
    """Router logits and the selection-only correction bias, kept in fp32 at any model dtype."""

    def __init__(self, cfg: TextConfig, device: torch.device | str) -> None:
        super().__init__()
        self.weight = weight(cfg.num_experts, cfg.hidden_size, dtype=torch.float32, device=device)


class MoE(nn.Module):
    def __init__(
        self, cfg: TextConfig, backend: Backend, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.gate = Router(cfg, device)
        self.e_score_correction_bias = weight(cfg.num_experts, dtype=torch.float32, device=device)
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size, backend, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        routed = self.backend.moe(
            x,
            self.gate.weight,
            self.e_score_correction_bias,
            self.experts.w13,
            self.experts.w2,
            cfg.num_experts_per_tok,
            cfg.swiglu_alpha,
            cfg.swiglu_limit,
        )
        # The routed scaling factor applies to the routed sum only, not to the shared expert.
        return routed * cfg.routed_scaling_factor + self.shared_experts(x)
