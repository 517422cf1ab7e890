"""The batch descriptor of one forward step over paged KV.

Prefill chunks, decode steps and multi-token verify steps are the same call: each request
contributes `extend_len` new tokens at positions [seq_len - extend_len, seq_len), whose KV is
written to the slots its page table names; everything before is read from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One request's part of a step: new token ids, where they start, and its pages."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0] == tokens already in the KV cache
    pages: Sequence[int]  # physical pages covering positions [0, start + len(token_ids))
    all_logits: bool = False  # logits for every new token (verify, parity tests) or just the last


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests back to back
    positions: torch.Tensor  # [T] int64 absolute positions
    out_slots: torch.Tensor  # [T] int64 physical KV slot each new token is written to
    page_table: torch.Tensor  # [B, max_pages] int32, -1 padded
    seq_lens: list[int]  # per request, tokens in the cache after this step
    extend_lens: list[int]  # per request, new tokens in this step
    logit_rows: torch.Tensor  # [N] rows of T whose logits the step returns
    page_size: int
    # The same per-request metadata as device tensors, for kernels (no host lists on the GPU).
    seq_lens_t: torch.Tensor | None = None  # [B] int32
    extend_starts: torch.Tensor | None = None  # [B + 1] int32, request b owns rows [s[b], s[b+1])
    max_extend: int = 0  # the longest extend_len in the batch

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls, chunks: Sequence[SeqChunk], page_size: int, device: torch.device | str
    ) -> ForwardBatch:
        if not chunks:
            raise ValueError("a forward batch needs at least one request")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            _check_chunk(chunk, page_size)
            first_row = len(ids)
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start + offset
                ids.append(int(token))
                positions.append(pos)
                slots.append(chunk.pages[pos // page_size] * page_size + pos % page_size)
            rows = range(first_row, len(ids))
            logit_rows.extend(rows if chunk.all_logits else rows[-1:])
        max_pages = max(len(c.pages) for c in chunks)
        table = [list(c.pages) + [-1] * (max_pages - len(c.pages)) for c in chunks]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        seq_lens = [c.start + len(c.token_ids) for c in chunks]
        extend_lens = [len(c.token_ids) for c in chunks]
        starts = [0]
        for ext in extend_lens:
            starts.append(starts[-1] + ext)
        return cls(
            input_ids=tensor(ids, torch.int64),
            positions=tensor(positions, torch.int64),
            out_slots=tensor(slots, torch.int64),
            page_table=tensor(table, torch.int32),
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            logit_rows=tensor(logit_rows, torch.int64),
            page_size=page_size,
            seq_lens_t=tensor(seq_lens, torch.int32),
            extend_starts=tensor(starts, torch.int32),
            max_extend=max(extend_lens),
        )


def _check_chunk(chunk: SeqChunk, page_size: int) -> None:
    if not chunk.token_ids:
        raise ValueError("a request in a forward batch has no new tokens")
    end = chunk.start + len(chunk.token_ids)
    needed = -(-end // page_size)
    if len(chunk.pages) < needed:
        raise ValueError(f"{end} tokens need {needed} pages, the request has {len(chunk.pages)}")
