"""Feed-forward blocks: the dense SwiGLU-OAI MLP and the routed MoE with one shared expert.

Under tensor parallelism (`model/parallel.py`) the MLPs hold their slice of the intermediate
width (gate/up rows, down_proj columns) and the MoE its experts' slices; each block sums its
ranks' partial outputs once, the MoE its routed and shared parts together."""

from __future__ import annotations

import torch
from torch import nn

from m3serve.kernels.nvfp4_tiles import CODES_PER_BYTE, tile_rows_
from m3serve.kernels.quant import NVFP4_GROUP
from m3serve.model.backend import Backend
from m3serve.model.config import TextConfig
from m3serve.model.parallel import SINGLE, Parallel
from m3serve.model.params import Linear, weight
from m3serve.model.weights import (
    DenseExperts,
    ExpertWeights,
    Nvfp4Experts,
    WeightFormat,
    WeightFormats,
)


class DenseMLP(nn.Module):
    """`base` is the checkpoint module the MLP comes from (`model.layers.0.mlp`). `width` is
    the full intermediate width; this rank holds `parallel.width(width)` of it. `reduce`: sum
    the ranks' partial outputs here (False: the caller sums them)."""

    def __init__(
        self,
        cfg: TextConfig,
        width: int,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
        base: str,
        parallel: Parallel = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.ranks = parallel.ranks if reduce else SINGLE.ranks
        h = cfg.hidden_size
        width = parallel.width(width).size
        # gate_proj and up_proj of the checkpoint, fused: gate rows first.
        gate_up = formats.of([f"{base}.gate_proj", f"{base}.up_proj"])
        self.gate_up_proj = Linear(h, 2 * width, dtype, device, gate_up)
        self.down_proj = Linear(width, h, dtype, device, formats.of([f"{base}.down_proj"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        gate_up = backend.linear(x, self.gate_up_proj.data)
        hidden = backend.swiglu(gate_up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return self.ranks.all_reduce(backend.linear(hidden, self.down_proj.data))


class Experts(nn.Module):
    """All routed experts of a layer, stacked. Dense: w13 [E, 2I, H] (w1 rows, then w3) and
    w2 [E, H, I]. NVFP4: the packed codes under the same names, plus `*_scale` (e4m3 per 16
    inputs) and `*_global` (float32; w13's per half) as `Nvfp4Experts` describes. E and I are
    this rank's: its experts and their intermediate slice."""

    def __init__(
        self,
        cfg: TextConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        fmt: WeightFormat,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        e, h = parallel.experts(cfg).size, cfg.hidden_size
        i = parallel.expert_width(cfg).size
        self.fmt = fmt
        self.tiled: Nvfp4Experts | None = None  # set by tile_rows_
        if fmt != "NVFP4":
            self.w13 = weight(e, 2 * i, h, dtype=dtype, device=device)
            self.w2 = weight(e, h, i, dtype=dtype, device=device)
            return
        codes, scale, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        self.w13 = weight(e, 2 * i, h // 2, dtype=codes, device=device)
        self.w13_scale = weight(e, 2 * i, h // NVFP4_GROUP, dtype=scale, device=device)
        self.w13_global = weight(e, 2, dtype=f32, device=device)
        self.w2 = weight(e, h, i // 2, dtype=codes, device=device)
        self.w2_scale = weight(e, h, i // NVFP4_GROUP, dtype=scale, device=device)
        self.w2_global = weight(e, dtype=f32, device=device)

    @torch.no_grad()
    def tile_rows_(self) -> None:
        """Hold the NVFP4 codes and scales row-tiled for the MoE kernels, in place, one expert
        of scratch at a time (the loader has filled them in the checkpoint's layout)."""
        if self.fmt != "NVFP4" or self.tiled is not None:
            return
        w13 = tile_rows_(self.w13.data, CODES_PER_BYTE)
        w2 = tile_rows_(self.w2.data, CODES_PER_BYTE)
        w13_scale = tile_rows_(self.w13_scale.data, NVFP4_GROUP)
        w2_scale = tile_rows_(self.w2_scale.data, NVFP4_GROUP)
        self.tiled = Nvfp4Experts(
            w13, w13_scale, self.w13_global, w2, w2_scale, self.w2_global, tiled=True
        )

    @property
    def data(self) -> ExpertWeights:
        """What the backend's `moe` reads."""
        if self.fmt != "NVFP4":
            return DenseExperts(self.w13, self.w2)
        if self.tiled is not None:  # views of the parameters' storage, made once
            return self.tiled
        return Nvfp4Experts(
            self.w13, self.w13_scale, self.w13_global, self.w2, self.w2_scale, self.w2_global
        )


class Router(nn.Module):
    """Router logits and the selection-only correction bias, kept in fp32 at any model dtype."""

    def __init__(self, cfg: TextConfig, device: torch.device | str) -> None:
        super().__init__()
        self.weight = weight(cfg.num_experts, cfg.hidden_size, dtype=torch.float32, device=device)


class MoE(nn.Module):
    """`base` is the checkpoint module (`model.layers.3.block_sparse_moe`)."""

    def __init__(
        self,
        cfg: TextConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
        base: str,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.ranks = parallel.ranks
        # The router is replicated: every rank routes every token over all experts.
        self.first_expert = parallel.experts(cfg).start
        self.gate = Router(cfg, device)
        self.e_score_correction_bias = weight(cfg.num_experts, dtype=torch.float32, device=device)
        experts = [
            f"{base}.experts.{e}.{w}" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")
        ]
        self.experts = Experts(cfg, dtype, device, formats.of(experts), parallel)
        shared = f"{base}.shared_experts"
        width = cfg.shared_intermediate_size
        self.shared_experts = DenseMLP(
            cfg, width, backend, dtype, device, formats, shared, parallel, reduce=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        # The routed scaling factor applies to the routed sum only, not to the shared expert.
        both = self.backend.moe(
            x,
            self.gate.weight,
            self.e_score_correction_bias,
            self.experts.data,
            cfg.num_experts_per_tok,
            cfg.swiglu_alpha,
            cfg.swiglu_limit,
            cfg.routed_scaling_factor,
            first_expert=self.first_expert,
            shared=lambda: self.shared_experts(x),
        )
        # One collective for both partial sums (routed: this rank's experts or slices of them).
        return self.ranks.all_reduce(both)
