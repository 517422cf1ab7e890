"""Paged KV addressing: a request's page table row -> the physical slot of each of its tokens;
and the tiles of query rows the torch references score at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch

# The most query-key scores (per head, summed over heads) a reference op holds at once. A
# prefill chunk is scored a tile of query rows at a time, so its peak memory is a few times this
# (16 MiB of fp32), not chunk x prompt x heads: one 8K chunk of a 64K prompt would otherwise hold
# several GiB per layer.
SCORE_TILE_ELEMENTS = 1 << 22


def sequence_slots(page_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Physical slots [seq_len] of positions 0..seq_len-1 of one request (int64)."""
    num_pages = -(-seq_len // page_size)
    pages = page_row[:num_pages].long()
    offsets = torch.arange(page_size, device=page_row.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]


def row_tiles(rows: int, heads: int, seq_len: int) -> Iterator[slice]:
    """Consecutive slices of `rows` query rows, each scoring at most `SCORE_TILE_ELEMENTS`
    query-key pairs over `heads` heads and `seq_len` keys (at least one row per tile)."""
    step = max(1, SCORE_TILE_ELEMENTS // max(1, heads * seq_len))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))
