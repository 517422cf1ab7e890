"""Paged KV addressing: a request's page table row -> the physical slot of each of its tokens."""

from __future__ import annotations

import torch


def sequence_slots(page_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Physical slots [seq_len] of positions 0..seq_len-1 of one request (int64)."""
    num_pages = -(-seq_len // page_size)
    pages = page_row[:num_pages].long()
    offsets = torch.arange(page_size, device=page_row.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]


def token_slots(
    page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Physical slot of each (request row, position) pair, e.g. where new tokens' KV is written."""
    pages = page_table[rows, positions // page_size].long()
    return pages * page_size + positions % page_size
