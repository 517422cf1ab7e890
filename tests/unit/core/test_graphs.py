"""The decode graphs' static inputs: after any sequence of steps of any row counts and page-table
widths, the rows a step uses hold its values and every other row holds padding (a token at
position 0 of the scratch page), although a step resets only the rows a bigger step left. Graphs
that draw their rows: each row's knobs reach the draw, the tokens reach the slots' table, and a
replay for logits alone draws greedy padding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.graphs import DecodeGraphs, GraphDraw, _Captured
from m3serve.core.sampler import DRAW_KNOBS

BS, MAX_PAGES, PAGE, SCRATCH = 8, 6, 4, 99


def _graphs() -> tuple[DecodeGraphs, _Captured]:
    model: Any = SimpleNamespace(device=torch.device("cpu"))
    kv: Any = SimpleNamespace(page_size=PAGE)
    graphs = DecodeGraphs(model, kv, SCRATCH, BS, MAX_PAGES)
    logits = torch.zeros(BS, 1)
    return graphs, _Captured(graph=None, batch=graphs._static_batch(BS), logits=logits)  # type: ignore[arg-type]


def _step(rows: int, width: int, seed: int) -> Any:
    """What `_load` reads of a decode step's batch, with values no padding row holds."""
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        input_ids=torch.randint(1, 1000, (rows,), generator=gen),
        positions=torch.randint(1, 1000, (rows,), generator=gen),
        out_slots=torch.randint(0, SCRATCH * PAGE, (rows,), generator=gen),
        page_table=torch.randint(0, SCRATCH, (rows, width), generator=gen, dtype=torch.int32),
        seq_lens_t=torch.randint(2, 1000, (rows,), generator=gen, dtype=torch.int32),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, BS), st.integers(1, MAX_PAGES)), min_size=1, max_size=8))
def test_static_rows_hold_the_step_then_padding(steps: list[tuple[int, int]]) -> None:
    graphs, captured = _graphs()
    for seed, (rows, width) in enumerate(steps):
        step = _step(rows, width, seed)
        graphs._load(captured, step, rows)
        static = captured.batch
        assert torch.equal(static.input_ids[:rows], step.input_ids)
        assert torch.equal(static.positions[:rows], step.positions)
        assert torch.equal(static.out_slots[:rows], step.out_slots)
        assert torch.equal(static.page_table[:rows, :width], step.page_table)
        assert (static.page_table[:rows, width:] == -1).all()
        assert torch.equal(static.seq_lens_t[:rows], step.seq_lens_t)
        # Every other row: one token at position 0 of the scratch page.
        assert (static.input_ids[rows:] == 0).all() and (static.positions[rows:] == 0).all()
        assert (static.out_slots[rows:] == SCRATCH * PAGE).all()
        assert (static.page_table[rows:, 0] == SCRATCH).all()
        assert (static.page_table[rows:, 1:] == -1).all()
        assert (static.seq_lens_t[rows:] == 1).all()


def _drawing_graphs(num_slots: int) -> DecodeGraphs:
    """Graphs of batch sizes 1, 2, 4 over a stand-in model, each "replay" running the captured
    forward eagerly; their draw writes seed + 1000 x offset as each row's token, so a token
    says which knobs its row got."""

    def forward_hidden(batch: Any, kv: Any) -> torch.Tensor:
        return batch.input_ids.float()[:, None]

    def sample(logits: torch.Tensor, *knobs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        seeds, offsets = knobs[4], knobs[5]
        return out.copy_(seeds + 1000 * offsets)

    model: Any = SimpleNamespace(
        device=torch.device("cpu"),
        hidden_states=forward_hidden,
        compute_logits=lambda hidden: hidden.repeat(1, 3),
    )
    kv: Any = SimpleNamespace(page_size=PAGE)
    last_tokens = torch.full((num_slots + 1,), -7, dtype=torch.int64)
    draw = GraphDraw(sample, DRAW_KNOBS, last_tokens)
    graphs = DecodeGraphs(model, kv, SCRATCH, 4, MAX_PAGES, draw)
    for bs in graphs.sizes:
        batch, drawn = graphs._static_batch(bs), graphs._static_draw(bs)
        replay = lambda batch=batch, drawn=drawn: graphs._forward(batch, drawn)  # noqa: E731
        logits = torch.zeros(bs, 3)
        graph: Any = SimpleNamespace(replay=replay)
        graphs.graphs[bs] = _Captured(graph, batch, logits, drawn=drawn)
    return graphs


def test_a_graph_that_draws_gives_each_row_its_knobs_and_writes_the_slots_tokens() -> None:
    graphs = _drawing_graphs(num_slots=6)
    assert graphs.draw is not None
    table = graphs.draw.last_tokens
    step = _step(3, 2, seed=0)
    step.seq_lens = [5, 5, 5]
    knobs = [[1.0] * 4, [0] * 4, [0.9] * 4, [0.0] * 4, [11, 12, 13, 0], [1, 2, 3, 0]]
    tokens = graphs.run_and_draw(step, knobs, [5, 0, 3])  # the 4-row graph, a padding row
    assert tokens.tolist() == [1011, 2012, 3013]
    assert table.tolist() == [2012, -7, -7, 3013, -7, 1011, 0]  # the padding's: the scratch
    captured = graphs.graphs[4]
    assert captured.drawn is not None and captured.drawn.inputs.views[6].tolist() == [5, 0, 3, 6]
    with pytest.raises(ValueError, match="2 slots for a step of 3 rows"):
        graphs.run_and_draw(step, knobs, [5, 0])


def test_a_graph_replayed_for_logits_alone_draws_greedy_padding_into_the_scratch_slot() -> None:
    """A step that samples outside the graph (penalties, logprobs, a grammar) still replays
    its draw: its knobs go back to the padding's first, so it draws little and writes only
    the scratch slot."""
    graphs = _drawing_graphs(num_slots=2)
    assert graphs.draw is not None
    step = _step(2, 1, seed=1)
    step.seq_lens = [3, 3]
    graphs.run_and_draw(step, [[1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [4, 5], [6, 7]], [0, 1])
    table = graphs.draw.last_tokens.clone()
    logits = graphs.run(step)
    assert logits.shape == (2, 3)
    views = graphs.graphs[2].drawn.inputs.views  # type: ignore[union-attr]
    assert [v.tolist() for v in views] == [
        [0.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0], [0, 0], [0, 0], [2, 2]
    ]  # fmt: skip
    assert graphs.draw.last_tokens[:2].tolist() == table[:2].tolist()
