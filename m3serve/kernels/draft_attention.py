"""The DSpark draft's block attention over a paged draft KV pool (torch reference, batched).

Each of B requests brings a block of S query slots at positions anchor, anchor + 1, …,
anchor + S − 1. Slot s attends, non-causally, to (a) the request's context in the pool at
positions p < anchor with (anchor + s) − p < window (SGLang's window_left = window − 1), read
through its page table, and (b) all S keys of its own block, which are passed in, not pooled
(the block's K/V are never committed as context: the context is keyed from target features).

The context is gathered for the last L = min(window − 1, pages × page_size) positions before
every anchor at once, a fixed shape, so there is no loop over requests; positions below 0 are
masked. Semantics follow `attention.attention`: scores in q's dtype, softmax in fp32.
"""

from __future__ import annotations

import torch


def context_slots(
    page_table: torch.Tensor, anchor_pos: torch.Tensor, page_size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions [B, L], KV slots [B, L] and validity [B, L] of the `width` positions before
    each anchor (anchor − width … anchor − 1); invalid ones (below 0, or on an unmapped page)
    point at slot 0."""
    offsets = torch.arange(-width, 0, device=anchor_pos.device)
    positions = anchor_pos.long()[:, None] + offsets
    valid = positions >= 0
    safe = positions.clamp(min=0)
    index = (safe // page_size).clamp(max=page_table.shape[1] - 1)
    pages = page_table.long().gather(1, index)
    valid &= pages >= 0
    slots = pages.clamp(min=0) * page_size + safe % page_size
    return positions, torch.where(valid, slots, 0), valid


def draft_attention(
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
    """q [B·S, Hq, D], the block's own k/v [B·S, Hkv, D] (request b owns rows [b·S, (b+1)·S));
    k_pool/v_pool [slots, Hkv, D]; page_table [B, P] int (−1 padded); anchor_pos [B] int
    -> [B·S, Hq, D] in q's dtype."""
    batch = anchor_pos.shape[0]
    rows, num_heads, head_dim = q.shape
    block, num_kv = rows // batch, k.shape[1]
    group = num_heads // num_kv
    shape = (batch, block, num_kv, head_dim)
    width = max(0, min(window - 1, page_table.shape[1] * page_size))
    positions, slots, valid = context_slots(page_table, anchor_pos, page_size, width)
    q_pos = anchor_pos.long()[:, None] + torch.arange(block, device=q.device)  # [B, S]
    in_window = q_pos[:, :, None] - positions[:, None, :] < window
    allowed = torch.cat(
        (
            valid[:, None, :] & in_window,
            torch.ones(batch, block, block, dtype=torch.bool, device=q.device),
        ),
        dim=2,
    )  # [B, S, L + S]
    keys = torch.cat((_gather(k_pool, slots, valid, q.dtype), k.view(*shape)), dim=1)
    values = torch.cat((_gather(v_pool, slots, valid, q.dtype), v.view(*shape)), dim=1)
    qh = q.view(batch, block, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)  # [B,Hkv,G,S,D]
    scores = torch.matmul(qh, keys.permute(0, 2, 3, 1)[:, :, None]) * scale  # [B,Hkv,G,S,L+S]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3)[:, :, None])  # [B,Hkv,G,S,D]
    return out.permute(0, 3, 1, 2, 4).reshape(rows, num_heads, head_dim)


def _gather(
    pool: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """pool[slots] [B, L, Hkv, D] in `dtype`, zero where not valid: a masked key still meets
    its value in P·V (0 × a stale NaN would be NaN)."""
    rows = pool[slots].to(dtype)
    return torch.where(
        valid[:, :, None, None], rows, torch.zeros((), dtype=dtype, device=rows.device)
    )
