"""The batch descriptor of one forward step over paged KV.

Prefill chunks, decode steps and multi-token verify steps are the same call: each request (a
`SeqStep` of the scheduler's plan) contributes `extend_len` new tokens at positions
[seq_len - extend_len, seq_len), whose KV is written to the slots its page table names;
everything before is read from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from m3serve.model.host_copy import upload_many
from m3serve.model.slot_pages import SlotPages
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
    decode_rows: int = 0  # how many requests in front have extend_len 1 (a mixed step's decodes)
    # Rows of T whose input embedding is given instead of looked up (image/video features):
    # eager prefill steps only; CUDA-graph paths never carry them.
    embeds_override: torch.Tensor | None = None  # [R, hidden]
    override_rows: torch.Tensor | None = None  # [R] int64
    # `logit_rows` on the host, where the batch was built there: a graph that draws the rows
    # takes them in its one copy up (core/head_draw.py).
    logit_rows_host: np.ndarray | None = field(default=None, compare=False)

    def with_embeds(self, rows: torch.Tensor, embeds: torch.Tensor) -> ForwardBatch:
        """The same batch with the embeddings of `rows` replaced by `embeds` (none: unchanged)."""
        if rows.numel() == 0:
            return self
        device = self.input_ids.device
        return replace(self, override_rows=rows.to(device), embeds_override=embeds.to(device))

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
        slot_pages: SlotPages | None = None,
        slot_tokens: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The batch of `seqs`. Logits are for the last new token of each sampled seq, or with
        `all_logits` for every new token (parity tests). A seq without input ids gets
        placeholder tokens (a verify row: one per token) its caller overwrites on the device;
        with `slot_tokens` (the device's last token of each slot) its first is its slot's.

        With `slot_pages` the seqs' page changes are applied to it and the page table is its
        rows, gathered on the device; without, every seq carries its whole page list. Either
        way the step's host arrays go up in one copy.

        Per-token metadata is computed with numpy, not per token in Python: a step of a few
        thousand prompt tokens would otherwise spend milliseconds here before it launches."""
        if not seqs:
            raise ValueError("a forward batch needs at least one request")
        for seq in seqs:
            _check_seq(seq, page_size, whole=slot_pages is None)
        starts = np.fromiter((s.start for s in seqs), np.int64, len(seqs))
        extends = np.fromiter((s.extend for s in seqs), np.int64, len(seqs))
        ends = np.cumsum(extends)
        rows = np.repeat(np.arange(len(seqs)), extends)  # the seq each new token belongs to
        first_rows = ends - extends  # each seq's first row in the batch
        positions = starts[rows] + np.arange(int(ends[-1])) - first_rows[rows]
        max_pages = max(s.num_pages for s in seqs)
        changed = None  # the slot lists' changes, to send with the batch
        if slot_pages is None:
            table = np.full((len(seqs), max_pages), -1, np.int64)
            for i, seq in enumerate(seqs):
                table[i, : len(seq.pages)] = seq.pages
            slots = table[rows, positions // page_size] * page_size + positions % page_size
            pages_item = (table, torch.int32)  # the page table itself
        else:
            changed = slot_pages.changes(seqs)
            held = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
            pages = slot_pages.host[held[rows], positions // page_size]
            slots = pages * page_size + positions % page_size
            pages_item = (held, torch.int64)  # the rows of the slot table to gather
        if all_logits:
            logit_rows = np.arange(int(ends[-1]))
        else:
            logit_rows = np.array(
                [end - 1 for s, end in zip(seqs, ends, strict=True) if s.sample], np.int64
            )
        ids = [t for s in seqs for t in ([0] * s.extend if s.input_ids is None else s.input_ids)]

        seq_lens = starts + extends
        items = [
            (ids, torch.int64),
            (positions, torch.int64),
            (slots, torch.int64),
            (logit_rows, torch.int64),
            (seq_lens, torch.int32),
            (np.concatenate([[0], ends]), torch.int32),
            pages_item,
        ]
        token_rows = _slot_token_rows(seqs, first_rows) if slot_tokens is not None else None
        if token_rows is not None:
            items += token_rows
        if changed is not None:
            items += changed
        # One host-to-device copy for the whole step's metadata.
        sent = upload_many(items, device)
        input_ids, positions_t, out_slots, logit_rows_t, seq_lens_t, starts_t, pages_t = sent[:7]
        if token_rows is not None:
            assert slot_tokens is not None
            rows_t, slots_t = sent[7:9]
            input_ids.index_copy_(0, rows_t, slot_tokens.index_select(0, slots_t))
        if slot_pages is None:
            page_table = pages_t
        else:  # index_select, not advanced indexing: a fraction of the host time a step
            if changed is not None:
                slot_pages.write(*sent[-2:])
            page_table = torch.index_select(slot_pages.table[:, :max_pages], 0, pages_t)
        return cls(
            input_ids=input_ids,
            positions=positions_t,
            out_slots=out_slots,
            page_table=page_table,
            seq_lens=seq_lens.tolist(),
            extend_lens=extends.tolist(),
            logit_rows=logit_rows_t,
            page_size=page_size,
            seq_lens_t=seq_lens_t,
            extend_starts=starts_t,
            max_extend=int(extends.max()),
            decode_rows=len(seqs) if (extends == 1).all() else int((extends == 1).argmin()),
            logit_rows_host=logit_rows,
        )


def _slot_token_rows(
    seqs: Sequence[SeqStep], first_rows: np.ndarray
) -> list[tuple[np.ndarray, torch.dtype]] | None:
    """The first batch row of each seq without input ids, and its slot (None: no such seq):
    its token there is the slot's last, from the device's table."""
    fresh = [i for i, seq in enumerate(seqs) if seq.input_ids is None]
    if not fresh:
        return None
    slots = np.fromiter((seqs[i].slot for i in fresh), np.int64, len(fresh))
    return [(first_rows[fresh], torch.int64), (slots, torch.int64)]


def _check_seq(seq: SeqStep, page_size: int, whole: bool) -> None:
    if seq.extend == 0:
        raise ValueError("a request in a forward batch has no new tokens")
    if whole and seq.page_start:
        raise ValueError("a batch without slot pages needs every seq's whole page list")
    end = seq.start + seq.extend
    needed = -(-end // page_size)
    if seq.num_pages < needed:
        raise ValueError(f"{end} tokens need {needed} pages, the request has {seq.num_pages}")
