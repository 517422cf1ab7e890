"""The op contract between the network and a hardware backend: every op the model calls.

It lives with the model so that model code depends on nothing but this; `m3serve.backends`
implements it (the exact torch reference, Triton kernels on Hopper) and is chosen at start.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import LayerKV
from m3serve.model.weights import ExpertWeights, LinearWeight


@dataclass(frozen=True)
class HeadInputs:
    """One layer's raw projections, split per head, with their norm weights."""

    q: torch.Tensor  # [T, Hq, D]
    q_norm: torch.Tensor  # [D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_norm: torch.Tensor  # [D]
    # The lightning indexer's (sparse layers only): queries [T, Hi, Di], the one key head [T, Di].
    index_q: torch.Tensor | None = None
    index_q_norm: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    index_k_norm: torch.Tensor | None = None


class Backend(Protocol):
    name: str
    device: torch.device
    # True when no op reads the batch's host-side lists or syncs with the host, so that a whole
    # decode step can be captured in a CUDA graph and replayed.
    capturable: bool
    # The checkpoint formats this backend's ops read as stored ("MXFP8", "NVFP4"); weights in
    # any other format are dequantized at load.
    weight_formats: frozenset[str]

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Once the checkpoint is loaded: rearrange what this backend's kernels read in another
        layout than the checkpoint's (in place, values unchanged)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] @ W^T (+ bias [N]) for a dense or MXFP8 weight W [N, K] -> [T, N] in x's
        dtype."""
        ...

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

    def attention_inputs(
        self,
        layer: LayerKV,
        batch: ForwardBatch,
        heads: HeadInputs,
        eps: float,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head norm + RoPE of every projection of `heads`: the queries and index queries
        are returned (index queries None without an indexer); the keys and index keys are
        written to the cache slots of the batch's new tokens, with the values as they are."""
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

    def layer_loop(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        """Around one step's loop over the layers with `batch`: inside it a backend may keep
        what the first layer worked out from the batch alone for the layers after it."""
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

    def draft_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        page_table: torch.Tensor,
        anchor_pos: torch.Tensor,
        page_size: int,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """The DSpark draft's block attention: B blocks of S slots, q [B·S, Hq, D] at positions
        anchor_pos [B] (device) + 0..S−1, each slot over its request's paged draft context
        k_pool/v_pool [slots, Hkv, D] before the anchor within `window`, and non-causally over
        its block's own k/v [B·S, Hkv, D]; page_table [B, P] (−1 padded) -> [B·S, Hq, D]."""
        ...

    def swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def moe(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        bias: torch.Tensor,
        experts: ExpertWeights,
        top_k: int,
        alpha: float,
        limit: float,
        scale: float,
        first_expert: int = 0,
        shared: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum times the routed scaling factor `scale`, plus
        `shared()` (the shared expert's output) when given. Routing picks among all of
        `router_weight`'s experts; `experts` holds those from `first_expert` on (expert
        parallelism), and picks outside them add nothing (other ranks hold them). A backend may
        run `shared` beside the routed experts; it must only read what exists before the call."""
        ...
