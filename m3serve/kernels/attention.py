"""Attention over paged KV, dense-causal or block-sparse (torch reference).

Semantics follow HF's eager path: scores in the input dtype, scaled, masked, softmax in fp32.
A query attends to the keys of its selected blocks that are not in its future. A request's rows
are scored a tile at a time (`row_tiles`), so memory stays bounded for long prompts.
"""

from __future__ import annotations

import torch

from m3serve.kernels.paged import row_tiles, sequence_slots


def block_mask(
    block_ids: torch.Tensor, positions: torch.Tensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """block_ids [n, H, K] (-1 padded) -> allowed keys [H, n, seq_len] (selection and causality)."""
    n, heads, _ = block_ids.shape
    num_blocks = -(-seq_len // block_size)
    # -1 entries scatter into a spare column that is dropped.
    safe = block_ids.long().masked_fill(block_ids < 0, num_blocks)
    keep = torch.zeros(n, heads, num_blocks + 1, dtype=torch.bool, device=block_ids.device)
    keep.scatter_(-1, safe, True)
    keep = keep[..., :num_blocks].repeat_interleave(block_size, dim=-1)[..., :seq_len]
    return keep.permute(1, 0, 2) & causal_mask(positions, seq_len)[None]


def causal_mask(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    return torch.arange(seq_len, device=positions.device)[None, :] <= positions[:, None]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, Hq, D], k/v [S, Hkv, D], allowed [Hm, n, S] with Hm dividing Hq -> [n, Hq, D]."""
    n, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qh = q.permute(1, 0, 2).reshape(num_kv, group, n, head_dim)
    scores = torch.matmul(qh, k.permute(1, 2, 0)[:, None]) * scale
    # A mask head covers num_heads // Hm consecutive query heads (GQA group or index head).
    mask = allowed.repeat_interleave(num_heads // allowed.shape[0], dim=0)
    scores = scores.masked_fill(~mask.view(num_kv, group, n, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2)[:, None])
    return out.reshape(num_heads, n, head_dim).permute(1, 0, 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    positions: torch.Tensor,
    page_size: int,
    scale: float,
    block_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a batch of requests whose new tokens' KV is already in the cache.

    q: [T, Hq, D] new tokens of all requests, request b owning rows [start_b, start_b + ext_b).
    block_ids: [T, H_idx, K] sparse selection, or None for dense causal attention.
    """
    out = torch.empty_like(q)
    start = 0
    for row, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        rows = slice(start, start + ext)
        start += ext
        slots = sequence_slots(page_table[row], seq_len, page_size)
        keys, values = k_cache[slots], v_cache[slots]
        for tile in row_tiles(ext, q.shape[1], seq_len):
            tile = slice(rows.start + tile.start, rows.start + tile.stop)
            pos = positions[tile]
            if block_ids is None:
                allowed = causal_mask(pos, seq_len)[None]
            else:
                allowed = block_mask(block_ids[tile], pos, seq_len, page_size)
            out[tile] = attention(q[tile], keys, values, allowed, scale)
    return out
