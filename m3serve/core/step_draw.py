"""Where a step's sampled rows are drawn: the part of `StepRunner` (core/step_runner.py) that
queues a step's forward and the draw of its sampled rows, on the executor thread.

A plain decode step whose rows need nothing but the draw is drawn inside its decode graph
(`_graph_draw`, core/graphs.py); a step that runs through the piecewise graphs (prompt chunks)
has its sampled rows' head and draw replayed as one graph after them (`_head_draw`,
core/head_draw.py); any other step, or a row that needs penalties, logprobs or a grammar's mask,
samples outside any graph (`_queue_draw`, core/sampler.py). Each way the tokens stay on the
device, also written to the slots' token table as their next decode inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from m3serve.core.device_clock import DeviceSpan
from m3serve.core.graphs import GraphDraw, StepInput
from m3serve.core.hicache.copier import LayerLoad
from m3serve.core.sampler import DRAW_KNOBS
from m3serve.model.batch import ForwardBatch
from m3serve.model.host_copy import upload
from m3serve.runtime.messages import TokenLogprob

if TYPE_CHECKING:
    from m3serve.core.step_runner import StepRunner

Drawn = tuple[torch.Tensor, list[TokenLogprob | None]]


class StepDraws:
    """`StepRunner`'s base: the draws. Everything they read is the runner's."""

    def graph_draw(self: StepRunner) -> GraphDraw | None:
        """What decode graphs need to draw this runner's rows themselves (`_graph_draw`);
        None where the sampler has no device draw."""
        sample = self.sampler.device_draw
        return None if sample is None else GraphDraw(sample, DRAW_KNOBS, self.last_tokens)

    def _draw(
        self: StepRunner,
        batch: StepInput,
        slots: list[int],
        rows: int,
        load: LayerLoad | None,
        span: DeviceSpan | None,
    ) -> Drawn:
        """The forward of `batch` (`rows` rows, `slots` the sampled ones) and their draw,
        queued: in the decode graph where it can draw them, after the piecewise graphs in a
        head graph (`_head_draw`), else outside any graph (`_queue_draw`)."""
        drawn = self._graph_draw(batch, slots, rows, load, span)
        if drawn is None:
            drawn = self._head_draw(batch, slots, load, span)
        if drawn is None:
            drawn = self._queue_draw(self.logits(batch, len(slots) == rows, load), slots, span)
        return drawn

    def _graph_draw(
        self: StepRunner,
        batch: StepInput,
        slots: list[int],
        rows: int,
        load: LayerLoad | None,
        span: DeviceSpan | None,
    ) -> Drawn | None:
        """The forward and the rows' draw in one decode graph, queued (core/graphs.py
        `run_and_draw`): the tokens on the device, also as the slots' next inputs, as
        `_queue_draw` gives them. None where the step or a row needs more than the draw (a
        prompt chunk, images, a grammar's mask, penalties, logprobs) or no graph draws."""
        graphs = self.graphs
        if graphs is None or not graphs.draws or len(slots) != rows or not graphs.fits(batch):
            return None
        knobs = self._graph_knobs(slots, graphs.bucket(rows))
        if knobs is None:
            return None
        if load is not None:
            load.wait_all()  # a replayed graph has no per-layer hook
        return _drawn(graphs.run_and_draw(batch, knobs, slots), span)

    def _head_draw(
        self: StepRunner,
        batch: StepInput,
        slots: list[int],
        load: LayerLoad | None,
        span: DeviceSpan | None,
    ) -> Drawn | None:
        """The forward through the piecewise graphs and the sampled rows' head and draw in one
        graph replay (core/head_draw.py), queued; None where the step does not run through the
        piecewise graphs or a row needs more than the draw (as `_graph_draw`)."""
        heads, piecewise = self.heads, self.piecewise
        if heads is None or piecewise is None or not heads.holds(len(slots)):
            return None
        if not isinstance(batch, ForwardBatch) or batch.logit_rows_host is None:
            return None
        if batch.override_rows is not None or not piecewise.fits(batch):
            return None
        knobs = self._graph_knobs(slots, heads.bucket(len(slots)))
        if knobs is None:
            return None
        piecewise.run(batch, load.before_layer if load is not None else None)
        return _drawn(heads.run(batch.logit_rows_host, knobs, slots), span)

    def _graph_knobs(
        self: StepRunner, slots: list[int], bucket: int
    ) -> list[list[int] | list[float]] | None:
        """The knobs of a draw in a graph of `bucket` rows (Sampler.graph_knobs), counting the
        rows' draws; None where a row needs more than that draw (a grammar's mask, penalties,
        logprobs) or the ranks share the tokens."""
        if self.share is not None or any(self.matchers.constrains(slot) for slot in slots):
            return None
        return self.sampler.graph_knobs(slots, bucket)

    def _queue_draw(
        self: StepRunner, logits: torch.Tensor, slots: list[int], span: DeviceSpan | None
    ) -> Drawn:
        """The rows' draw, queued: the tokens on the device, also as the slots' next inputs;
        the step's device `span` ends behind it."""
        # After the launch, before the draw: on a GPU this host work overlaps the forward.
        allowed = self.matchers.fill(slots)
        index = upload(slots, torch.int64, self.device)
        tokens, logprobs = self.sampler.sample(logits, slots, allowed, slots_t=index)
        share = self.share
        if share is not None and self.spec is None:  # rank 0: the followers' next inputs
            share.share_ids(tokens)
        self.last_tokens[index] = tokens
        if span is not None:
            span.stop()
        return tokens, logprobs


def _drawn(tokens: torch.Tensor, span: DeviceSpan | None) -> Drawn:
    """Tokens drawn in a graph: the step's device `span` ends behind them; no logprobs."""
    if span is not None:
        span.stop()
    return tokens, [None] * len(tokens)
