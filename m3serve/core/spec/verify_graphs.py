"""CUDA graphs for the target's verify forward: per batch-size bucket of verify rows, the target
pass over [anchor, d_1..d_γ] per row (every layer, the draft's target-layer features kept) and
the logits at all γ + 1 positions, captured over a static batch.

Only steps made of verify rows alone replay (any prefill chunk or plain decode row makes the
step's shape data-dependent; it runs eagerly). Padding rows are γ + 1 tokens at positions
0..γ on the scratch page no request owns, as the decode graphs' (core/graphs.py).

The logits and features come out through buffers sized for the largest bucket and shared by
all buckets (one copy inside each graph), so their memory does not grow with the bucket count;
being outside the graphs' memory pool, no other graph sharing that pool can overwrite them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from m3serve.core.graph_set import GraphSet
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark_paged import target_pass
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SeqStep


class VerifyGraphs:
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        layer_ids: Sequence[int],
        gamma: int,
        scratch_page: int,
        sizes: Sequence[int],
        max_pages: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv, self.layer_ids = model, kv, list(layer_ids)
        self.width = gamma + 1
        # Padding rows' page-table entries: the scratch page for every position 0..γ.
        self.pad_pages = -(-self.width // kv.page_size)
        self.scratch_page, self.max_pages = scratch_page, max(max_pages, self.pad_pages)
        device = model.device
        most = max(sizes) * self.width
        vocab = model.cfg.vocab_size
        feature = len(self.layer_ids) * model.cfg.hidden_size
        self._logits = torch.empty(most, vocab, dtype=torch.float32, device=device)
        self._features = torch.empty(most, feature, dtype=model.dtype, device=device)
        self.graphs = GraphSet(sizes, self._static_batch, self._forward, device, capture)

    @property
    def sizes(self) -> list[int]:
        return self.graphs.sizes

    def capture(self, pool: object | None = None) -> object | None:
        return self.graphs.capture(pool)

    def fits(self, seqs: Sequence[SeqStep], batch: ForwardBatch) -> bool:
        return (
            len(seqs) <= self.graphs.max_bs
            and all(seq.draft and seq.extend == self.width for seq in seqs)
            and batch.page_table.shape[1] <= self.max_pages
            and batch.override_rows is None
        )

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, V] fp32 of every row and the features [T, F] (views of shared buffers:
        use them before the next replay)."""
        rows = len(batch.seq_lens)
        bs = self.graphs.bucket(rows)
        self._load(self.graphs.inputs(bs), batch, rows)
        logits, features = self.graphs.replay(bs)
        tokens = rows * self.width
        return logits[:tokens], features[:tokens]

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, features = target_pass(self.model, batch, self.kv, self.layer_ids)
        tokens = hidden.shape[0]
        self._logits[:tokens].copy_(self.model.compute_logits(hidden))
        self._features[:tokens].copy_(features)
        return self._logits[:tokens], self._features[:tokens]

    def _static_batch(self, bs: int) -> ForwardBatch:
        device, page, width = self.model.device, self.kv.page_size, self.width
        tokens = bs * width
        batch = ForwardBatch(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(tokens, dtype=torch.int64, device=device),
            out_slots=torch.zeros(tokens, dtype=torch.int64, device=device),
            page_table=torch.full((bs, self.max_pages), -1, dtype=torch.int32, device=device),
            seq_lens=[width] * bs,
            extend_lens=[width] * bs,
            logit_rows=torch.arange(tokens, device=device),
            page_size=page,
            seq_lens_t=torch.full((bs,), width, dtype=torch.int32, device=device),
            extend_starts=torch.arange(bs + 1, dtype=torch.int32, device=device) * width,
            max_extend=width,
        )
        self._pad(batch, 0)
        return batch

    def _pad(self, static: ForwardBatch, rows: int) -> None:
        """Rows from `rows` on become padding: tokens 0 at positions 0..γ on the scratch page."""
        page, width = self.kv.page_size, self.width
        offsets = torch.arange(width, device=static.positions.device)
        start = rows * width
        static.input_ids[start:].zero_()
        static.positions[start:].view(-1, width).copy_(offsets)
        scratch = self.scratch_page * page + offsets % page
        static.out_slots[start:].view(-1, width).copy_(scratch)
        static.page_table[rows:].fill_(-1)
        static.page_table[rows:, : self.pad_pages] = self.scratch_page
        assert static.seq_lens_t is not None
        static.seq_lens_t[rows:].fill_(width)
        static.seq_lens[rows:] = [width] * (len(static.seq_lens) - rows)

    def _load(self, static: ForwardBatch, batch: ForwardBatch, rows: int) -> None:
        """Copy a verify step into the static buffers; the rows past it become padding."""
        tokens, width = rows * self.width, batch.page_table.shape[1]
        static.input_ids[:tokens].copy_(batch.input_ids)
        static.positions[:tokens].copy_(batch.positions)
        static.out_slots[:tokens].copy_(batch.out_slots)
        static.page_table[:rows, :width].copy_(batch.page_table)
        static.page_table[:rows, width:].fill_(-1)
        assert static.seq_lens_t is not None and batch.seq_lens_t is not None
        static.seq_lens_t[:rows].copy_(batch.seq_lens_t)
        # The host copy too: no capturable backend reads it, but the eager run (tests, on the
        # reference backend) does.
        static.seq_lens[:rows] = batch.seq_lens
        self._pad(static, rows)
