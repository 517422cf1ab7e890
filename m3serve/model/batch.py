"""The batch descriptor of one forward step over paged KV.

Prefill chunks, decode steps and multi-token verify steps are the same call: each request (a
`SeqStep` of the scheduler's plan) contributes `extend_len` new tokens at positions
[seq_len - extend_len, seq_len), whose KV is written to the slots its page table names;
everything before is read from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3serve.runtime.messages import SeqStep


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
        cls,
        seqs: Sequence[SeqStep],
        page_size: int,
        device: torch.device | str,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """The batch of `seqs`. Logits are for the last new token of each sampled seq, or with
        `all_logits` for every new token (parity tests). A seq without input ids gets a
        placeholder token its caller overwrites on the device."""
        if not seqs:
            raise ValueError("a forward batch needs at least one request")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for seq in seqs:
            _check_seq(seq, page_size)
            first_row = len(ids)
            ids.extend([0] if seq.input_ids is None else seq.input_ids)
            for pos in range(seq.start, seq.start + seq.extend):
                positions.append(pos)
                slots.append(seq.pages[pos // page_size] * page_size + pos % page_size)
            rows = range(first_row, len(ids))
            logit_rows.extend(rows if all_logits else rows[-1:] if seq.sample else ())
        max_pages = max(len(s.pages) for s in seqs)
        table = [list(s.pages) + [-1] * (max_pages - len(s.pages)) for s in seqs]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        seq_lens = [s.start + s.extend for s in seqs]
        extend_lens = [s.extend for s in seqs]
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


def _check_seq(seq: SeqStep, page_size: int) -> None:
    if seq.extend == 0:
        raise ValueError("a request in a forward batch has no new tokens")
    end = seq.start + seq.extend
    needed = -(-end // page_size)
    if len(seq.pages) < needed:
        raise ValueError(f"{end} tokens need {needed} pages, the request has {len(seq.pages)}")
