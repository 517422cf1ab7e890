"""The draw of a step run through the piecewise graphs: its sampled rows' logits and tokens in
one CUDA graph per row bucket.

A step with a prompt chunk leaves the decode graphs for the piecewise ones (core/piecewise.py),
whose last piece leaves every token's final-normed hidden state in a static buffer. Its sampled
rows then went through the head and the sampler eagerly: a gather of their hidden rows, the LM
head, the float cast, the knobs' upload, the Triton draw's four launches (each through Triton's
argument binding) and the token table's scatter. On the H200's host that was ~0.64 ms of a
16-stream mixed step's ~2.4 ms launch (`perf/bench_step_host.py --chunk 256`,
perf/results/h200_2026-12-07_mixed_launch/), and a mixed step is launched while the step before
runs: where its launch outlasts that step, the device waits for it.

Here the rows' hidden-state indices, their knobs and their slots go up in one copy and one
replay runs the rest: the gather, the head, the draw (`GraphDraw`, as the decode graphs draw)
and the write of the tokens to the slots' token table. Padding rows gather row 0, draw greedily
and write the table's scratch slot. Steps whose rows need more than the draw (penalties,
logprobs, a grammar's mask) sample as before (`StepRunner._queue_draw`).

Without CUDA (`capture=False`, tests) each bucket runs the same calls eagerly over the same
buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.core.graph_set import GraphSet
from m3serve.core.graphs import GraphDraw
from m3serve.model.host_copy import Packed
from m3serve.model.m3 import M3ForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Inputs:
    packed: Packed  # the hidden rows to draw from, then GraphDraw.knobs' order, then the slots
    # [size] int64, written by the draw. Made outside the graphs' memory pool: a graph's output
    # made in it could share memory with the intermediates of the decode graphs in that pool.
    tokens: torch.Tensor


class HeadDraws:
    def __init__(
        self,
        model: M3ForCausalLM,
        hidden: torch.Tensor,
        draw: GraphDraw,
        sizes: Sequence[int],
        capture: bool = True,
    ) -> None:
        """`hidden`: the piecewise graphs' static final-normed hidden states [N, hidden];
        `sizes`: the row buckets."""
        self.model = model
        self.hidden = hidden
        self.draw = draw
        self.graphs = GraphSet(sizes, self._inputs, self._forward, model.device, capture)

    def holds(self, rows: int) -> bool:
        return 0 < rows <= self.graphs.max_bs

    def bucket(self, rows: int) -> int:
        """The row count of the bucket `rows` sampled rows replay."""
        return self.graphs.bucket(rows)

    def capture(self, pool: object = None) -> object:
        """Every bucket captured into `pool` (the decode graphs': their steps never overlap
        these); the pool used."""
        pool = self.graphs.capture(pool)
        if self.graphs.captured:
            largest = self.graphs.max_bs
            log.info("captured the piecewise steps' draw for row buckets up to %d", largest)
        return pool

    def run(
        self, rows: np.ndarray, knobs: Sequence[Sequence[float]], slots: Sequence[int]
    ) -> torch.Tensor:
        """The tokens [len(rows)] int64 of the hidden states' `rows` (host indices into the
        static buffer, the sampled rows in order), drawn with `knobs` (each the bucket's size
        long: Sampler.graph_knobs) and written to the token table's `slots` entries."""
        count = len(rows)
        if len(slots) != count:
            raise ValueError(f"{len(slots)} slots for {count} rows")
        size = self.bucket(count)
        padding = size - count
        index = np.concatenate([np.asarray(rows, np.int64), np.zeros(padding, np.int64)])
        scratch = [self.draw.scratch_slot] * padding
        self.graphs.inputs(size).packed.fill([index, *knobs, [*slots, *scratch]])
        return self.graphs.replay(size)[:count]

    def _inputs(self, size: int) -> _Inputs:
        device = self.model.device
        specs = [(size, torch.int64), *((size, dtype) for dtype, _ in self.draw.knobs)]
        packed = Packed([*specs, (size, torch.int64)], device)
        # Every row padding until a step fills it: row 0, greedy, into the scratch slot.
        fills = [[0] * size, *([fill] * size for _, fill in self.draw.knobs)]
        packed.fill([*fills, [self.draw.scratch_slot] * size])
        return _Inputs(packed, torch.zeros(size, dtype=torch.int64, device=device))

    def _forward(self, inputs: _Inputs) -> torch.Tensor:
        rows, *knobs, slots = inputs.packed.views
        logits = self.model.compute_logits(self.hidden.index_select(0, rows))
        self.draw.sample(logits, *knobs, out=inputs.tokens)
        self.draw.last_tokens.index_copy_(0, slots, inputs.tokens)
        return inputs.tokens
