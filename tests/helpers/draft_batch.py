"""Random inputs of the DSpark draft's block attention, and a naive per-request oracle.

The pool has shuffled physical pages and is NaN in every slot no request's context owns, so a
stray read poisons the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.attention import attention


@dataclass(frozen=True)
class DraftBatch:
    q: torch.Tensor  # [B·S, Hq, D]
    k: torch.Tensor  # [B·S, Hkv, D] the blocks' own keys
    v: torch.Tensor
    k_pool: torch.Tensor  # [slots, Hkv, D]
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [B, P] int32, −1 padded
    anchor_pos: torch.Tensor  # [B] int64
    page_size: int
    window: int
    scale: float

    def args(self) -> tuple:
        return (
            self.q, self.k, self.v, self.k_pool, self.v_pool, self.page_table, self.anchor_pos,
            self.page_size, self.window, self.scale,
        )  # fmt: skip

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DraftBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        return DraftBatch(
            move(self.q), move(self.k), move(self.v), move(self.k_pool), move(self.v_pool),
            self.page_table.to(device), self.anchor_pos.to(device), self.page_size,
            self.window, self.scale,
        )  # fmt: skip


def make_draft_batch(
    anchors: list[int],
    *,
    block: int = 7,
    num_kv: int = 2,
    group: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    window: int = 10,
    seed: int = 0,
) -> DraftBatch:
    """One block per anchor position; request b's context is positions [0, anchors[b])."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(a + block) // page_size) for a in anchors]  # the block's pages too
    total = sum(counts) + 3  # spare pages nobody owns stay NaN
    order = torch.randperm(total, generator=gen).tolist()
    shape = (total * page_size, num_kv, head_dim)
    k_pool = torch.full(shape, float("nan"))
    v_pool = torch.full(shape, float("nan"))
    table = torch.full((len(anchors), max(counts) + 1), -1, dtype=torch.int32)
    cursor = 0
    for row, (anchor, count) in enumerate(zip(anchors, counts, strict=True)):
        pages = order[cursor : cursor + count]
        cursor += count
        table[row, :count] = torch.tensor(pages, dtype=torch.int32)
        # Slots at and after the anchor (the block's own) stay NaN: the pool must not be read.
        for pos in range(max(0, anchor - window + 1), anchor):
            slot = pages[pos // page_size] * page_size + pos % page_size
            k_pool[slot] = torch.randn(num_kv, head_dim, generator=gen)
            v_pool[slot] = torch.randn(num_kv, head_dim, generator=gen)
    rows = len(anchors) * block
    return DraftBatch(
        q=torch.randn(rows, num_kv * group, head_dim, generator=gen),
        k=torch.randn(rows, num_kv, head_dim, generator=gen),
        v=torch.randn(rows, num_kv, head_dim, generator=gen),
        k_pool=k_pool,
        v_pool=v_pool,
        page_table=table,
        anchor_pos=torch.tensor(anchors, dtype=torch.int64),
        page_size=page_size,
        window=window,
        scale=head_dim**-0.5,
    )


def naive_draft_attention(batch: DraftBatch) -> torch.Tensor:
    """Request by request: gather the window's context through the page table, mask each slot's
    window, append the block's keys, and call the dense reference op."""
    block = batch.q.shape[0] // len(batch.anchor_pos)
    out = torch.empty_like(batch.q)
    for row, anchor in enumerate(batch.anchor_pos.tolist()):
        positions = torch.arange(max(0, anchor - batch.window + 1), anchor)
        pages = batch.page_table[row].long()[positions // batch.page_size]
        slots = pages * batch.page_size + positions % batch.page_size
        own = slice(row * block, (row + 1) * block)
        keys = torch.cat((batch.k_pool[slots].to(batch.q.dtype), batch.k[own]))
        values = torch.cat((batch.v_pool[slots].to(batch.q.dtype), batch.v[own]))
        q_pos = anchor + torch.arange(block)
        ctx = q_pos[:, None] - positions[None, :] < batch.window
        allowed = torch.cat((ctx, torch.ones(block, block, dtype=torch.bool)), dim=1)
        out[own] = attention(batch.q[own], keys, values, allowed[None], batch.scale)
    return out
