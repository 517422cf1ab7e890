"""CUDA graphs for decode steps: one captured forward (hidden states and logits) per batch-size
bucket, replayed after the step's metadata is copied into the graph's static buffers.

Padding rows (a step of 5 requests replays the 8-bucket) read and write a scratch page that no
request owns, so they cannot disturb real KV. Kernels are compiled by a warm-up run before
capture; nothing in the captured region syncs with the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def buckets_up_to(max_bs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_bs]
    return [*sizes, max_bs]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the static input buffers
    logits: torch.Tensor  # [bs, vocab] fp32, written by replay
    # Rows from here on hold padding (all of them at capture): a step resets only the rows a
    # bigger step before it left, so a steady batch queues no padding writes at all.
    padded_from: int = 0


class DecodeGraphs:
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        scratch_page: int,
        max_bs: int,
        max_pages: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.scratch_page = scratch_page
        self.max_pages = max_pages
        self.sizes = buckets_up_to(max_bs)
        self.graphs: dict[int, _Captured] = {}
        self.pool = None

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        device = self.model.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                batch = self._static_batch(bs)
                self._forward(batch)  # compile and autotune every kernel outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits = self._forward(batch)
                self.pool = graph.pool()
                self.graphs[bs] = _Captured(graph, batch, logits)
        torch.cuda.current_stream(device).wait_stream(stream)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def fits(self, batch: ForwardBatch) -> bool:
        rows = len(batch.seq_lens)
        return (
            batch.max_extend == 1
            and rows <= self.max_bs
            and batch.page_table.shape[1] <= self.max_pages
            and batch.num_tokens == rows
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step (every row's token is sampled)."""
        rows = len(batch.seq_lens)
        bs = next(size for size in self.sizes if size >= rows)
        captured = self.graphs[bs]
        self._load(captured, batch, rows)
        captured.graph.replay()
        return captured.logits[:rows]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model.hidden_states(batch, self.kv)
            return self.model.compute_logits(hidden)

    def _static_batch(self, bs: int) -> ForwardBatch:
        device = self.model.device
        page = self.kv.page_size
        batch = ForwardBatch(
            input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
            positions=torch.zeros(bs, dtype=torch.int64, device=device),
            out_slots=torch.full((bs,), self.scratch_page * page, dtype=torch.int64, device=device),
            page_table=torch.full((bs, self.max_pages), -1, dtype=torch.int32, device=device),
            seq_lens=[1] * bs,
            extend_lens=[1] * bs,
            logit_rows=torch.arange(bs, device=device),
            page_size=page,
            seq_lens_t=torch.ones(bs, dtype=torch.int32, device=device),
            extend_starts=torch.arange(bs + 1, dtype=torch.int32, device=device),
            max_extend=1,
        )
        self._pad(batch, 0, bs)
        return batch

    def _load(self, captured: _Captured, batch: ForwardBatch, rows: int) -> None:
        """Copy a step into the static buffers; rows past `rows` become scratch-page padding."""
        static = captured.batch
        width = batch.page_table.shape[1]
        static.input_ids[:rows].copy_(batch.input_ids)
        static.positions[:rows].copy_(batch.positions)
        static.out_slots[:rows].copy_(batch.out_slots)
        static.page_table[:rows, :width].copy_(batch.page_table)
        if width < self.max_pages:
            static.page_table[:rows, width:].fill_(-1)
        assert batch.seq_lens_t is not None
        static.seq_lens_t[:rows].copy_(batch.seq_lens_t)
        if rows < captured.padded_from:
            self._pad(static, rows, captured.padded_from)
        captured.padded_from = rows

    def _pad(self, static: ForwardBatch, start: int, end: int) -> None:
        """Rows [start, end) become padding: one token at position 0 of the scratch page (its
        KV write lands there, never in a request's page)."""
        static.input_ids[start:end].zero_()
        static.positions[start:end].zero_()
        static.out_slots[start:end].fill_(self.scratch_page * self.kv.page_size)
        static.page_table[start:end].fill_(-1)
        static.page_table[start:end, 0] = self.scratch_page
        assert static.seq_lens_t is not None
        static.seq_lens_t[start:end].fill_(1)
