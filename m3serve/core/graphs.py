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

A plain decode step of a lone rank need not be built as a `ForwardBatch` first: given as its
rows (`DecodeRows`: positions, KV slots and slots as host arrays), its positions, KV slots,
lengths and slots go into the graph's static inputs with its knobs in one copy, and its tokens
and page lists are gathered there from the slots' device tables (two launches). Built as a
batch, the same step made an upload and a page-table gather, an upload and two launches for its
tokens, and six copies into the static buffers: 0.28-0.42 ms of host time a step on an H100's
host, the largest part of a decode step's host time once the draw moved into the graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from m3serve.core.graph_set import capture_graph, capture_stream
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


@dataclass(frozen=True)
class DecodeRows:
    """A decode step given as its rows (one new token each) rather than as a built batch: host
    arrays, and the device tables row i's input token and page list are gathered from (their
    entries `slots[i]`)."""

    positions: np.ndarray  # [n] int64: each row's new token's position (its KV length before)
    out_slots: np.ndarray  # [n] int64: the KV slot that token's KV is written to
    slots: np.ndarray  # [n] int64
    tokens: torch.Tensor  # [>= slots] int64: each slot's last token, its next decode input
    pages: torch.Tensor  # [>= slots, >= the graphs' max_pages] int32: page lists, -1 past them
    max_pages: int  # the longest page list among the rows

    def __len__(self) -> int:
        return len(self.slots)


# What a step runs from: its built batch, or a plain decode step's rows.
StepInput = ForwardBatch | DecodeRows

# A bucket's static inputs filled from the host (`_Captured.inputs`): positions, KV slots and
# lengths (the static batch's), and the slots its rows' tokens and page lists are gathered from;
# then, for a graph that draws, its knobs (GraphDraw.knobs' order) and the slots its tokens go to.
ROW_INPUTS = (torch.int64, torch.int64, torch.int32, torch.int64)
GATHER_SLOTS = 3
KNOBS_FROM = len(ROW_INPUTS)


@dataclass
class _Drawn:
    """A graph's draw: the tokens it writes."""

    tokens: torch.Tensor  # [bs] int64
    greedy: bool = True  # its knobs are the padding's (every row greedy)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    inputs: Packed  # the static inputs from the host, one allocation (ROW_INPUTS on)
    batch: ForwardBatch  # the static input buffers (its positions, out_slots, seq_lens_t: views)
    logits: torch.Tensor | None = None  # [bs, vocab] fp32, written by replay
    # Rows from here on hold padding (all of them at capture): a step resets only the rows a
    # bigger step before it left, so a steady batch queues no padding writes at all.
    padded_from: int = 0
    drawn: _Drawn | None = None

    @property
    def size(self) -> int:
        return len(self.batch.seq_lens)


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
        with capture_stream(self.model.device) as stream:
            for bs in reversed(self.sizes):
                captured = self.bucket_inputs(bs)
                run = partial(self._forward, captured)
                captured.graph, captured.logits, self.pool = capture_graph(run, stream, self.pool)
                self.graphs[bs] = captured
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def holds(self, rows: int, pages: int) -> bool:
        """Whether a decode step of `rows` rows, none longer than `pages` pages, has a graph."""
        return rows <= self.max_bs and pages <= self.max_pages

    def fits(self, step: StepInput) -> bool:
        if isinstance(step, DecodeRows):
            return self.holds(len(step), step.max_pages)
        rows = len(step.seq_lens)
        return (
            step.max_extend == 1
            and self.holds(rows, step.page_table.shape[1])
            and step.num_tokens == rows
            and step.override_rows is None
        )

    @property
    def draws(self) -> bool:
        return self.draw is not None

    def bucket(self, rows: int) -> int:
        """The batch size of the graph a step of `rows` rows replays."""
        return next(size for size in self.sizes if size >= rows)

    def run(self, step: StepInput) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step (every row's token is sampled)."""
        rows = _rows(step)
        captured = self.graphs[self.bucket(rows)]
        drawn = captured.drawn
        greedy = None  # its draw keeps its knobs: the padding's already (or it has none)
        if drawn is not None and (isinstance(step, DecodeRows) or not drawn.greedy):
            # Rows go up with the knobs in one copy; and a draw with the last step's knobs
            # would redo its draw.
            greedy = self._greedy_inputs(captured.size)
            drawn.greedy = True
        self._load(captured, step, greedy)
        assert captured.graph is not None and captured.logits is not None
        captured.graph.replay()
        return captured.logits[:rows]

    def run_and_draw(
        self,
        step: StepInput,
        knobs: Sequence[Sequence[float]],
        slots: Sequence[int],
    ) -> torch.Tensor:
        """The rows' tokens [rows] int64 of a decode step, drawn in the graph with `knobs`
        (one list per knob, the graph's batch size long: Sampler.graph_knobs) and written to
        the token table's `slots` entries."""
        rows = _rows(step)
        captured = self.graphs[self.bucket(rows)]
        drawn = captured.drawn
        assert drawn is not None and self.draw is not None, "graphs captured without a draw"
        if len(slots) != rows:
            raise ValueError(f"{len(slots)} slots for a step of {rows} rows")
        padding = [self.draw.scratch_slot] * (len(knobs[0]) - rows)
        self._load(captured, step, [*knobs, [*slots, *padding]])
        drawn.greedy = False
        assert captured.graph is not None
        captured.graph.replay()
        return drawn.tokens[:rows]

    def bucket_inputs(self, bs: int) -> _Captured:
        """A bucket's static inputs and outputs, every row padding; not captured yet."""
        device = self.model.device
        specs = [(bs, dtype) for dtype in ROW_INPUTS]
        drawn = None
        if self.draw is not None:
            specs += [(bs, dtype) for dtype, _ in self.draw.knobs] + [(bs, torch.int64)]
            drawn = _Drawn(torch.zeros(bs, dtype=torch.int64, device=device))
        inputs = Packed(specs, device)
        captured = _Captured(None, inputs, self._static_batch(inputs), drawn=drawn)
        if self.draw is not None:
            inputs.fill(self._greedy_inputs(bs), first=KNOBS_FROM)
        return captured

    def _forward(self, captured: _Captured) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model.hidden_states(captured.batch, self.kv)
            logits = self.model.compute_logits(hidden)
            if captured.drawn is not None:
                assert self.draw is not None
                *knobs, slots = captured.inputs.views[KNOBS_FROM:]
                self.draw.sample(logits, *knobs, out=captured.drawn.tokens)
                self.draw.last_tokens.index_copy_(0, slots, captured.drawn.tokens)
            return logits

    def _greedy_inputs(self, bs: int) -> list[list[float]]:
        """Knobs and slots that make every row a padding row: greedy, into the scratch slot."""
        assert self.draw is not None
        return [*([fill] * bs for _, fill in self.draw.knobs), [self.draw.scratch_slot] * bs]

    def _static_batch(self, inputs: Packed) -> ForwardBatch:
        positions, out_slots, seq_lens = inputs.views[:GATHER_SLOTS]
        bs = positions.numel()
        device = self.model.device
        batch = ForwardBatch(
            input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
            positions=positions,
            out_slots=out_slots,
            page_table=torch.full((bs, self.max_pages), -1, dtype=torch.int32, device=device),
            seq_lens=[1] * bs,
            extend_lens=[1] * bs,
            logit_rows=torch.arange(bs, device=device),
            page_size=self.kv.page_size,
            seq_lens_t=seq_lens,
            extend_starts=torch.arange(bs + 1, dtype=torch.int32, device=device),
            max_extend=1,
        )
        self._pad(batch, 0, bs)
        return batch

    def _load(
        self,
        captured: _Captured,
        step: StepInput,
        draw_inputs: list[list[float]] | None,
    ) -> None:
        """A step into the static buffers, with `draw_inputs` (the knobs and slots of the
        graph's draw; None: those it has); rows past the step's become scratch-page padding."""
        rows = _rows(step)
        if isinstance(step, DecodeRows):
            self._load_rows(captured, step, draw_inputs or [])
        else:
            self._load_batch(captured, step)
            if draw_inputs is not None:
                captured.inputs.fill(draw_inputs, first=KNOBS_FROM)
        if rows < captured.padded_from:
            self._pad(captured.batch, rows, captured.padded_from)
        captured.padded_from = rows

    def _load_rows(
        self, captured: _Captured, step: DecodeRows, draw_inputs: list[list[float]]
    ) -> None:
        """Rows given on the host: their arrays (padded to the bucket) and `draw_inputs` in
        one copy, then their tokens and page lists gathered from the slots' tables."""
        rows, bs = len(step), captured.size
        padding = bs - rows
        scratch = self.scratch_page * self.kv.page_size
        host = [
            _padded(step.positions, padding, 0),
            _padded(step.out_slots, padding, scratch),
            _padded(step.positions + 1, padding, 1),
            _padded(step.slots, padding, 0),
        ]
        captured.inputs.fill([*host, *draw_inputs])
        static = captured.batch
        slots = captured.inputs.views[GATHER_SLOTS][:rows]
        torch.index_select(step.tokens, 0, slots, out=static.input_ids[:rows])
        pages = step.pages[:, : self.max_pages]
        torch.index_select(pages, 0, slots, out=static.page_table[:rows])

    def _load_batch(self, captured: _Captured, batch: ForwardBatch) -> None:
        """A built batch: its device tensors copied into the static buffers."""
        static = captured.batch
        rows = len(batch.seq_lens)
        width = batch.page_table.shape[1]
        static.input_ids[:rows].copy_(batch.input_ids)
        static.positions[:rows].copy_(batch.positions)
        static.out_slots[:rows].copy_(batch.out_slots)
        static.page_table[:rows, :width].copy_(batch.page_table)
        if width < self.max_pages:
            static.page_table[:rows, width:].fill_(-1)
        assert static.seq_lens_t is not None and batch.seq_lens_t is not None
        static.seq_lens_t[:rows].copy_(batch.seq_lens_t)

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


def _rows(step: StepInput) -> int:
    return len(step) if isinstance(step, DecodeRows) else len(step.seq_lens)


def _padded(values: np.ndarray, padding: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(padding, fill, values.dtype)]) if padding else values
