"""Paged KV memory for the text backbone: per layer, K, V and (sparse layers) the index keys.

Physical layout is slot-major: page p owns slots [p * page_size, (p + 1) * page_size). A page
is one sparse block, so a selected block id maps to one page of a request's page table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.model.config import TextConfig


@dataclass
class LayerKV:
    k: torch.Tensor  # [slots, kv_heads, head_dim]
    v: torch.Tensor  # [slots, kv_heads, head_dim]
    index_k: torch.Tensor | None  # [slots, index_head_dim]; None on full-attention layers


@dataclass
class KVCache:
    layers: list[LayerKV]
    num_pages: int
    page_size: int

    @classmethod
    def allocate(
        cls,
        cfg: TextConfig,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_heads: int | None = None,
    ) -> KVCache:
        """`kv_heads`: the KV heads this rank caches (tensor parallelism); default all."""
        slots = num_pages * cfg.page_size
        kv_shape = (slots, kv_heads or cfg.num_kv_heads, cfg.head_dim)
        layers = [
            LayerKV(
                k=torch.zeros(kv_shape, dtype=dtype, device=device),
                v=torch.zeros(kv_shape, dtype=dtype, device=device),
                index_k=(
                    torch.zeros(slots, cfg.index_head_dim, dtype=dtype, device=device)
                    if cfg.is_sparse(i)
                    else None
                ),
            )
            for i in range(cfg.num_layers)
        ]
        return cls(layers=layers, num_pages=num_pages, page_size=cfg.page_size)

    @staticmethod
    def bytes_per_page(cfg: TextConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """One page's bytes over every layer; `kv_heads`: this rank's KV heads (default all)."""
        item = torch.empty((), dtype=dtype).element_size()
        kv_size = (kv_heads or cfg.num_kv_heads) * cfg.head_dim
        per_token = sum(
            2 * kv_size + (cfg.index_head_dim if cfg.is_sparse(i) else 0)
            for i in range(cfg.num_layers)
        )
        return per_token * cfg.page_size * item
