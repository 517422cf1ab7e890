"""Self-attention of one decoder layer: GQA with per-head QK norm, partial RoPE, and (on sparse
layers) the lightning indexer that picks which KV blocks each query attends to.

The q, k, v (and indexer q, k) projections are one fused weight, `qkv_proj`, rows in that
order, so the layer reads its input once and the backend runs them as one launch.

Under tensor parallelism (`model/parallel.py`) each rank holds the rows of its heads in
`qkv_proj` (column-parallel) and the matching columns of `o_proj` (row-parallel), whose partial
outputs are summed over the ranks."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from m3serve.model.backend import Backend, HeadInputs
from m3serve.model.batch import ForwardBatch
from m3serve.model.config import TextConfig
from m3serve.model.kv_cache import LayerKV
from m3serve.model.parallel import SINGLE, Parallel
from m3serve.model.params import Linear, Norm
from m3serve.model.weights import WeightFormats


class Attention(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        layer: int,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.ranks = parallel.ranks
        self.sparse = cfg.is_sparse(layer)
        # This rank's head counts (all of them on one rank).
        self.heads = parallel.q_heads(cfg).size
        self.kv_heads = parallel.kv_heads(cfg).size
        self.index_heads = parallel.index_heads(cfg).size
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.splits = qkv_rows(cfg, self.sparse, parallel)
        base = f"model.layers.{layer}.self_attn."
        fused = [base + name for name in QKV_PROJECTIONS[: len(self.splits)]]
        self.qkv_proj = Linear(h, sum(self.splits), dtype, device, formats.of(fused))
        o_fmt = formats.of([base + "o_proj"])
        self.o_proj = Linear(self.heads * cfg.head_dim, h, dtype, device, o_fmt)
        self.q_norm = Norm(cfg.head_dim, eps, dtype, device)
        self.k_norm = Norm(cfg.head_dim, eps, dtype, device)
        if self.sparse:
            self.index_q_norm = Norm(cfg.index_head_dim, eps, dtype, device)
            self.index_k_norm = Norm(cfg.index_head_dim, eps, dtype, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: LayerKV, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        q, index_q = self.project(x, batch, kv, inv_freq)
        return self.output(self.attend(q, index_q, batch, kv))

    def project(
        self, x: torch.Tensor, batch: ForwardBatch, kv: LayerKV, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries [T, Hq, D] and (sparse layers) index queries of the new tokens, with
        their keys, values and index keys written to the cache. Reads only the token count,
        positions and cache slots of the batch, so it can run inside a CUDA graph."""
        cfg = self.cfg
        n = x.shape[0]
        parts = self.backend.linear(x, self.qkv_proj.data).split(self.splits, dim=-1)
        heads = HeadInputs(
            q=parts[0].view(n, self.heads, cfg.head_dim),
            q_norm=self.q_norm.weight,
            k=parts[1].view(n, self.kv_heads, cfg.head_dim),
            v=parts[2].view(n, self.kv_heads, cfg.head_dim),
            k_norm=self.k_norm.weight,
        )
        if self.sparse:
            heads = replace(
                heads,
                index_q=parts[3].view(n, self.index_heads, cfg.index_head_dim),
                index_q_norm=self.index_q_norm.weight,
                index_k=parts[4],
                index_k_norm=self.index_k_norm.weight,
            )
        # Every norm of the layer is built with the config's one epsilon.
        return self.backend.attention_inputs(kv, batch, heads, self.k_norm.eps, inv_freq)

    def attend(
        self, q: torch.Tensor, index_q: torch.Tensor | None, batch: ForwardBatch, kv: LayerKV
    ) -> torch.Tensor:
        """Attention of the new tokens over the cache, [T, q_size]: the part of the layer that
        reads each request's lengths and page table."""
        cfg, backend = self.cfg, self.backend
        block_ids = None
        if index_q is not None:
            block_ids = backend.index_topk(
                index_q,
                kv,
                batch,
                cfg.index_topk_blocks,
                cfg.index_local_blocks,
                cfg.index_init_blocks,
            )
        out = backend.attention(q, kv, batch, cfg.head_dim**-0.5, block_ids)
        return out.reshape(q.shape[0], self.heads * cfg.head_dim)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        # Row-parallel: each rank's product covers its heads only; the sum is the output.
        return self.ranks.all_reduce(self.backend.linear(attn, self.o_proj.data))


# The checkpoint projections fused into `qkv_proj`, in row order (full-attention layers have no
# indexer: the first three).
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")


def qkv_rows(cfg: TextConfig, sparse: bool, parallel: Parallel = SINGLE) -> list[int]:
    """The row count of each projection fused into `qkv_proj` on this rank, in
    `QKV_PROJECTIONS` order (the single index-K head is on every rank)."""
    kv = parallel.kv_heads(cfg).size * cfg.head_dim
    rows = [parallel.q_heads(cfg).size * cfg.head_dim, kv, kv]
    if sparse:
        rows += [parallel.index_heads(cfg).size * cfg.index_head_dim, cfg.index_head_dim]
    return rows
