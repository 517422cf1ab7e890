"""Plain decode steps handed to the decode graphs as their rows (core/graphs.py `DecodeRows`, core/
step_runner.py `_decode_rows`): their tokens and page lists gathered from the slots' tables on the
device instead of a built batch. With graphs that replay eagerly on the CPU, an engine core's
greedy outputs are those it gives without graphs and those of the built-batch path through the
same graphs, with steps launched ahead and not, while its batch grows and shrinks (padding rows)
and its rows cross pages, and when rows turn dead on a stop token and their slots serve waiting
requests; steps with prompt tokens still build their batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import M31_SPEC
from helpers.core_runs import greedy_outputs, small_cpu_core

from m3serve.core.engine_core import EngineCore
from m3serve.core.graphs import DecodeGraphs, DecodeRows, _Captured
from m3serve.core.step_runner import StepRunner
from m3serve.model.batch import ForwardBatch
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

# Prompts of different lengths and outputs of different lengths: the batch runs 3 rows (the
# 4-row graph, one padding row), then 2, then 1; a page is 4 tokens.
PROMPTS = [[5 + i % 50 for i in range(n)] for n in (37, 9, 22)]
OUTPUTS = [30, 12, 21]


@pytest.fixture(scope="module", params=["on", "off"], ids=["launch-ahead", "serial"])
def core(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[TinySpec], Path]
) -> Iterator[EngineCore]:
    engine = small_cpu_core(tiny_checkpoint(M31_SPEC), launch_ahead=request.param)
    yield engine
    engine.close()


def eager_graphs(core: EngineCore) -> DecodeGraphs:
    """Decode graphs for `core` whose replay runs the captured forward eagerly over the same
    static buffers (a CPU cannot capture)."""
    budget, vocab = core.budget, core.model.cfg.vocab_size
    graphs = DecodeGraphs(core.model, core.kv, budget.num_pages, 4, 64)

    def replay(captured: _Captured) -> None:
        # The reference backend reads the rows' lengths from the host lists, which a graph's
        # kernels never do: here they are the static lengths' values.
        static = captured.batch
        captured.batch = replace(static, seq_lens=static.seq_lens_t.tolist())
        try:
            assert captured.logits is not None
            captured.logits.copy_(graphs._forward(captured))
        finally:
            captured.batch = static

    for bs in graphs.sizes:
        captured = graphs.bucket_inputs(bs)
        captured.logits = torch.zeros(bs, vocab)
        captured.graph = SimpleNamespace(replay=lambda c=captured: replay(c))  # type: ignore[assignment]
        graphs.graphs[bs] = captured
    return graphs


def _outputs(
    core: EngineCore,
    prompts: list[list[int]] = PROMPTS,
    outputs: list[int] = OUTPUTS,
    stops: dict[int, int] | None = None,
) -> dict[str, list[int]]:
    """Greedy outputs of requests r0.. (`stops`: a stop token for some of them)."""
    return greedy_outputs(core, prompts, outputs, stops)


def test_decode_rows_give_the_outputs_of_built_batches_and_of_no_graphs(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = core.runner
    assert runner.graphs is None  # a CPU captures none
    plain = _outputs(core)
    runner.graphs = graphs = eager_graphs(core)
    steps: list[type] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda step: steps.append(type(step)) or run(step))
    try:
        with_rows = _outputs(core)
        row_steps = steps.count(DecodeRows)
        with monkeypatch.context() as patch:
            patch.setattr(StepRunner, "_decode_rows", lambda self, seqs: None)
            with_batches = _outputs(core)
    finally:
        runner.graphs = None
    assert with_rows == plain == with_batches
    assert [len(plain[f"r{i}"]) for i in range(3)] == OUTPUTS
    # Every decode step went to the graphs as rows (the first of each request is its prefill's).
    assert row_steps == max(OUTPUTS) - 1
    assert steps.count(ForwardBatch) == row_steps


def test_a_row_whose_slot_lacks_the_page_of_its_token_is_refused(core: EngineCore) -> None:
    runner = core.runner
    runner.graphs = eager_graphs(core)
    try:
        assert runner.slot_pages is not None
        runner.slot_pages.update([SeqStep([1, 2, 3], 0, [7], slot=3)])  # 1 page: positions 0..3
        same = {"slot": 3, "page_start": 1}  # no change to the slot's list
        assert isinstance(runner._decode_rows([SeqStep(None, 3, [], **same)]), DecodeRows)
        with pytest.raises(ValueError, match="slot 3: a token at position 4 needs 2 pages"):
            runner._decode_rows([SeqStep(None, 4, [], **same)])
        rows = runner._decode_rows([SeqStep(None, 4, [9], slot=3, page_start=1)])
        assert rows is not None and rows.out_slots.tolist() == [9 * 4]
        assert np.array_equal(rows.slots, [3]) and rows.max_pages == 2
        # Prompt tokens, a speculative row or more rows than a graph holds: a built batch.
        assert runner._decode_rows([SeqStep([5], 3, [], **same)]) is None
        assert runner._decode_rows([SeqStep(None, 3, [], draft=2, **same)]) is None
        many = [SeqStep(None, 0, [slot], slot=slot) for slot in range(5)]
        assert runner._decode_rows(many) is None
    finally:
        runner.graphs = None


def test_rows_of_requests_that_stop_run_dead_and_their_slots_serve_the_next(
    core: EngineCore,
) -> None:
    """Six requests on four slots, two ending on a stop token mid-way: under overlap their rows
    in the step planned before the stop was seen run dead, and waiting requests take their
    slots (a new page list for the slot, its tables gathered again)."""
    prompts = [*PROMPTS, [7] * 13, [9 + i for i in range(30)], [11] * 5]
    outputs = [*OUTPUTS, 16, 14, 9]
    free = _outputs(core, prompts, outputs)
    stops = {0: free["r0"][6], 2: free["r2"][3]}
    plain = _outputs(core, prompts, outputs, stops)
    core.runner.graphs = eager_graphs(core)
    try:
        with_rows = _outputs(core, prompts, outputs, stops)
    finally:
        core.runner.graphs = None
    assert with_rows == plain
    for i, stop in stops.items():
        ended = plain[f"r{i}"]
        assert ended[-1] == stop and len(ended) < outputs[i]
