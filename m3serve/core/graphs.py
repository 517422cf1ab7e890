"""CUDA graphs for decode steps: one captured forward (hidden states and logits) per batch-size
bucket, replayed after the step's metadata is copied into the graph's static buffers.

Padding rows (a step of 5 requests replays the 8-bucket) read and write a scratch page that no
request owns, so they cannot disturb real KV. Kernels are compiled by a warm-up run before
capture; nothing in the captured region syncs with the host.

With a `GraphDraw` each graph also draws the rows' tokens (the Triton sampler, from knobs in
static buffers filled by one copy) and writes them to the slots' token table, for steps whose
rows need nothing but the draw (`run_and_draw`; the sampler says which: core/sampler.py
`graph_knobs`). Drawn on the host's side, a batch-1 step made four sampler launches, six knob
uploads and the table's scatter: ~0.4 ms of the executor thread a step on an H100's host, on
the path of every step at concurrency 1 (perf/results/h100_2026-12-07f_step_host/). A step that
samples on its own (`run`) leaves the graphs' knobs greedy, so their draw costs little.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.host_copy import Packed
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def buckets_up_to(max_bs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_bs]
    return [*sizes, max_bs]


@dataclass(frozen=True)
class GraphDraw:
    """What a graph needs to draw its rows' tokens: the device draw (`sample`'s signature in
    kernels/triton/sampling.py), its knobs' dtypes and padding values (core/sampler.py
    `DRAW_KNOBS`), and the slots' token table the tokens go to (the decode inputs of the step
    after; its last entry is a scratch slot that padding rows write)."""

    sample: Callable[..., torch.Tensor]
    knobs: Sequence[tuple[torch.dtype, float]]
    last_tokens: torch.Tensor

    @property
    def scratch_slot(self) -> int:
        return self.last_tokens.shape[0] - 1


@dataclass
class _Drawn:
    """A graph's draw: its static knobs and slots (one allocation), and the tokens it writes."""

    inputs: Packed  # the knobs in GraphDraw.knobs' order, then the slots (int64)
    tokens: torch.Tensor  # [bs] int64
    greedy: bool = True  # its knobs are the padding's (every row greedy)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the static input buffers
    logits: torch.Tensor  # [bs, vocab] fp32, written by replay
    # Rows from here on hold padding (all of them at capture): a step resets only the rows a
    # bigger step before it left, so a steady batch queues no padding writes at all.
    padded_from: int = 0
    drawn: _Drawn | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        scratch_page: int,
        max_bs: int,
        max_pages: int,
        draw: GraphDraw | None = None,
    ) -> None:
        self.model = model
        self.draw = draw
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
                drawn = self._static_draw(bs)
                self._forward(batch, drawn)  # compile and autotune every kernel outside it
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits = self._forward(batch, drawn)
                self.pool = graph.pool()
                self.graphs[bs] = _Captured(graph, batch, logits, drawn=drawn)
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

    @property
    def draws(self) -> bool:
        return self.draw is not None

    def bucket(self, rows: int) -> int:
        """The batch size of the graph a step of `rows` rows replays."""
        return next(size for size in self.sizes if size >= rows)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step (every row's token is sampled)."""
        rows = len(batch.seq_lens)
        captured = self.graphs[self.bucket(rows)]
        self._load(captured, batch, rows)
        drawn = captured.drawn
        if drawn is not None and not drawn.greedy:  # its draw would redo the last step's
            drawn.inputs.fill(self._greedy_inputs(len(captured.batch.seq_lens)))
            drawn.greedy = True
        captured.graph.replay()
        return captured.logits[:rows]

    def run_and_draw(
        self, batch: ForwardBatch, knobs: Sequence[Sequence[float]], slots: Sequence[int]
    ) -> torch.Tensor:
        """The rows' tokens [rows] int64 of a decode step, drawn in the graph with `knobs`
        (one list per knob, the graph's batch size long: Sampler.graph_knobs) and written to
        the token table's `slots` entries."""
        rows = len(batch.seq_lens)
        captured = self.graphs[self.bucket(rows)]
        drawn = captured.drawn
        assert drawn is not None and self.draw is not None, "graphs captured without a draw"
        if len(slots) != rows:
            raise ValueError(f"{len(slots)} slots for a step of {rows} rows")
        self._load(captured, batch, rows)
        padding = [self.draw.scratch_slot] * (len(knobs[0]) - rows)
        drawn.inputs.fill([*knobs, [*slots, *padding]])
        drawn.greedy = False
        captured.graph.replay()
        return drawn.tokens[:rows]

    def _forward(self, batch: ForwardBatch, drawn: _Drawn | None = None) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model.hidden_states(batch, self.kv)
            logits = self.model.compute_logits(hidden)
            if drawn is not None:
                assert self.draw is not None
                *knobs, slots = drawn.inputs.views
                self.draw.sample(logits, *knobs, out=drawn.tokens)
                self.draw.last_tokens.index_copy_(0, slots, drawn.tokens)
            return logits

    def _static_draw(self, bs: int) -> _Drawn | None:
        """A bucket's static knobs (every row greedy), slots (the scratch slot) and tokens."""
        if self.draw is None:
            return None
        device = self.model.device
        specs = [(bs, dtype) for dtype, _ in self.draw.knobs] + [(bs, torch.int64)]
        drawn = _Drawn(Packed(specs, device), torch.zeros(bs, dtype=torch.int64, device=device))
        drawn.inputs.fill(self._greedy_inputs(bs))
        return drawn

    def _greedy_inputs(self, bs: int) -> list[list[float]]:
        """Knobs and slots that make every row a padding row: greedy, into the scratch slot."""
        assert self.draw is not None
        return [*([fill] * bs for _, fill in self.draw.knobs), [self.draw.scratch_slot] * bs]

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
