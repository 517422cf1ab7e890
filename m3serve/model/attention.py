"""Self-attention of one decoder layer: GQA with per-head QK norm, partial RoPE, and (on sparse
layers) the lightning indexer that picks which KV blocks each query attends to."""

from __future__ import annotations

import torch
from torch import nn

from m3serve.model.backend import Backend
from m3serve.model.batch import ForwardBatch
from m3serve.model.config import TextConfig
from m3serve.model.kv_cache import LayerKV
from m3serve.model.params import Linear, Norm


class Attention(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        layer: int,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.sparse = cfg.is_sparse(layer)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_proj = Linear(h, cfg.q_size, dtype, device)
        self.k_proj = Linear(h, cfg.kv_size, dtype, device)
        self.v_proj = Linear(h, cfg.kv_size, dtype, device)
        self.o_proj = Linear(cfg.q_size, h, dtype, device)
        self.q_norm = Norm(cfg.head_dim, eps, dtype, device)
        self.k_norm = Norm(cfg.head_dim, eps, dtype, device)
        if self.sparse:
            self.index_q_proj = Linear(h, cfg.index_n_heads * cfg.index_head_dim, dtype, device)
            self.index_k_proj = Linear(h, cfg.index_head_dim, dtype, device)
            self.index_q_norm = Norm(cfg.index_head_dim, eps, dtype, device)
            self.index_k_norm = Norm(cfg.index_head_dim, eps, dtype, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: LayerKV, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        cfg, backend = self.cfg, self.backend
        n = x.shape[0]
        q = self._project(x, self.q_proj, self.q_norm, cfg.num_heads, batch, inv_freq)
        # Keys are normalized, rotated and written to the cache in one backend op.
        k = backend.linear(x, self.k_proj.weight).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = backend.linear(x, self.v_proj.weight).view(n, cfg.num_kv_heads, cfg.head_dim)
        block_ids = None
        if self.sparse:
            index_q = self._project(
                x, self.index_q_proj, self.index_q_norm, cfg.index_n_heads, batch, inv_freq
            )
            index_k = backend.linear(x, self.index_k_proj.weight)
            backend.store_kv(
                kv,
                batch,
                k,
                v,
                self.k_norm.weight,
                index_k,
                self.index_k_norm.weight,
                self.k_norm.eps,
                inv_freq,
            )
            block_ids = backend.index_topk(
                index_q,
                kv,
                batch,
                cfg.index_topk_blocks,
                cfg.index_local_blocks,
                cfg.index_init_blocks,
            )
        else:
            backend.store_kv(
                kv, batch, k, v, self.k_norm.weight, None, None, self.k_norm.eps, inv_freq
            )
        out = backend.attention(q, kv, batch, cfg.head_dim**-0.5, block_ids)
        return backend.linear(out.reshape(n, cfg.q_size), self.o_proj.weight)

    def _project(
        self,
        x: torch.Tensor,
        proj: Linear,
        norm: Norm,
        heads: int,
        batch: ForwardBatch,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        y = self.backend.linear(x, proj.weight).view(x.shape[0], heads, -1)
        return self.backend.head_norm_rope(y, norm.weight, norm.eps, batch.positions, inv_freq)
