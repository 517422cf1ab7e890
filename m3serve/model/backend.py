"""The op contract between the network and a hardware backend: every op the model calls.

It lives with the model so that model code depends on nothing but this; `m3serve.backends`
implements it (the exact torch reference, Triton kernels on Hopper) and is chosen at start.
"""

from __future__ import annotations

from typing import Protocol

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import LayerKV


class Backend(Protocol):
    name: str
    device: torch.device
    # True when no op reads the batch's host-side lists or syncs with the host, so that a whole
    # decode step can be captured in a CUDA graph and replayed.
    capturable: bool

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """Per-head RMSNorm of x [T, H, D], then partial RoPE at positions."""
        ...

    def store_kv(
        self,
        layer: LayerKV,
        batch: ForwardBatch,
        k: torch.Tensor,
        v: torch.Tensor,
        k_norm: torch.Tensor,
        index_k: torch.Tensor | None,
        index_k_norm: torch.Tensor | None,
        eps: float,
        inv_freq: torch.Tensor,
    ) -> None:
        """Per-head norm + RoPE of the raw keys k [T, Hkv, D] and index keys [T, Di], then
        write k, v and the index keys to the cache slots of the batch's new tokens."""
        ...

    def index_topk(
        self,
        index_q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        topk: int,
        local_blocks: int,
        init_blocks: int,
    ) -> torch.Tensor:
        """Block ids [T, H_idx, topk] per new token; -1 padded, no duplicates."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        scale: float,
        block_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """[T, Hq, D] -> [T, Hq, D]; block_ids None means dense causal attention."""
        ...

    def swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def moe(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        bias: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        alpha: float,
        limit: float,
    ) -> torch.Tensor:
        """The routed experts' weighted sum (before the routed scaling factor)."""
        ...
