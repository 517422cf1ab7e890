"""Paged KV addressing: a request's page table row -> the physical slot of each of its tokens."""

from __future__ import annotations

import torch


def sequence_slots(page_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Physical slots [seq_len] of positions 0..seq_len-1 of one request (int64)."""
    num_pages = -(-seq_len // page_size)
    pages = page_row[:num_pages].long()
    offsets = torch.arange(page_size, device=page_row.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]
