"""The decode graphs' static inputs: after any sequence of steps of any row counts and page-table
widths, given as built batches or as rows (their tokens and page lists gathered from the slots'
tables), the rows a step uses hold its values and every other row holds padding (a token at
position 0 of the scratch page), although a step resets only the rows a bigger step left. Graphs
that draw their rows: each row's knobs reach the draw, the tokens reach the slots' table, and a
replay for logits alone draws greedy padding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.graphs import KNOBS_FROM, DecodeGraphs, DecodeRows, GraphDraw, _Captured
from m3serve.core.sampler import DRAW_KNOBS

BS, MAX_PAGES, PAGE, SCRATCH = 8, 6, 4, 99
SLOTS, TABLE_WIDTH = 12, MAX_PAGES + 3  # the slots' page table is wider than a graph's


def _graphs() -> tuple[DecodeGraphs, _Captured]:
    model: Any = SimpleNamespace(device=torch.device("cpu"))
    kv: Any = SimpleNamespace(page_size=PAGE)
    graphs = DecodeGraphs(model, kv, SCRATCH, BS, MAX_PAGES)
    return graphs, graphs.bucket_inputs(BS)


def _step(rows: int, width: int, seed: int) -> Any:
    """What `_load` reads of a decode step's batch, with values no padding row holds."""
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        input_ids=torch.randint(1, 1000, (rows,), generator=gen),
        positions=torch.randint(1, 1000, (rows,), generator=gen),
        out_slots=torch.randint(0, SCRATCH * PAGE, (rows,), generator=gen),
        page_table=torch.randint(0, SCRATCH, (rows, width), generator=gen, dtype=torch.int32),
        seq_lens_t=torch.randint(2, 1000, (rows,), generator=gen, dtype=torch.int32),
        seq_lens=[0] * rows,
    )


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's last token (values no padding row holds) and its page list (-1 past it)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    tokens = torch.randint(1, 1000, (SLOTS + 1,), generator=gen)
    pages = torch.randint(0, SCRATCH, (SLOTS, TABLE_WIDTH), generator=gen, dtype=torch.int32)
    lengths = torch.randint(1, MAX_PAGES + 1, (SLOTS, 1), generator=gen)
    pages[torch.arange(TABLE_WIDTH) >= lengths] = -1
    return tokens, pages


def _rows(rows: int, seed: int) -> DecodeRows:
    """A step of `rows` decode rows on distinct slots, positions and KV slots no padding holds."""
    tokens, pages = _tables(seed)
    rng = np.random.default_rng(seed)
    slots = rng.permutation(SLOTS)[:rows].astype(np.int64)
    positions = rng.integers(1, 1000, rows)
    out_slots = rng.integers(0, SCRATCH * PAGE, rows)
    most = int((pages[torch.from_numpy(slots)] >= 0).sum(1).max())
    return DecodeRows(positions, out_slots, slots, tokens, pages, most)


def _expected(step: Any, rows: int) -> tuple[torch.Tensor, ...]:
    """The values a step's rows hold in the static buffers: input ids, positions, KV slots,
    page-table rows (the graph's width), lengths."""
    if isinstance(step, DecodeRows):
        slots = torch.from_numpy(step.slots)
        positions = torch.from_numpy(step.positions)
        return (
            step.tokens[slots],
            positions,
            torch.from_numpy(step.out_slots),
            step.pages[slots, :MAX_PAGES],
            (positions + 1).int(),
        )
    width = step.page_table.shape[1]
    table = torch.full((rows, MAX_PAGES), -1, dtype=torch.int32)
    table[:, :width] = step.page_table
    return step.input_ids, step.positions, step.out_slots, table, step.seq_lens_t


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, BS), st.integers(1, MAX_PAGES), st.booleans()),
        min_size=1,
        max_size=8,
    )
)
def test_static_rows_hold_the_step_then_padding(steps: list[tuple[int, int, bool]]) -> None:
    graphs, captured = _graphs()
    for seed, (rows, width, as_rows) in enumerate(steps):
        step = _rows(rows, seed) if as_rows else _step(rows, width, seed)
        graphs._load(captured, step, None)
        static = captured.batch
        held = (
            static.input_ids[:rows],
            static.positions[:rows],
            static.out_slots[:rows],
            static.page_table[:rows],
            static.seq_lens_t[:rows],
        )
        for got, want in zip(held, _expected(step, rows), strict=True):
            assert torch.equal(got, want)
        # Every other row: one token at position 0 of the scratch page.
        assert (static.input_ids[rows:] == 0).all() and (static.positions[rows:] == 0).all()
        assert (static.out_slots[rows:] == SCRATCH * PAGE).all()
        assert (static.page_table[rows:, 0] == SCRATCH).all()
        assert (static.page_table[rows:, 1:] == -1).all()
        assert (static.seq_lens_t[rows:] == 1).all()


def test_rows_that_need_more_pages_than_a_graph_holds_do_not_fit() -> None:
    graphs, _ = _graphs()
    step = _rows(3, seed=0)
    assert graphs.fits(step)
    assert not graphs.fits(DecodeRows(**{**step.__dict__, "max_pages": MAX_PAGES + 1}))
    big = _rows(SLOTS, seed=0)
    assert len(big) > BS and not graphs.fits(big)


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
        captured = graphs.bucket_inputs(bs)
        captured.logits = torch.zeros(bs, 3)
        replay = lambda c=captured: c.logits.copy_(graphs._forward(c))  # noqa: E731
        captured.graph = SimpleNamespace(replay=replay)  # type: ignore[assignment]
        graphs.graphs[bs] = captured
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
    assert captured.inputs.views[KNOBS_FROM + 6].tolist() == [5, 0, 3, 6]
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
    views = graphs.graphs[2].inputs.views[KNOBS_FROM:]
    assert [v.tolist() for v in views] == [
        [0.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0], [0, 0], [0, 0], [2, 2]
    ]  # fmt: skip
    assert graphs.draw.last_tokens[:2].tolist() == table[:2].tolist()


def test_rows_drawn_in_a_graph_read_the_slots_tokens_and_write_their_draws_there() -> None:
    """Rows given as they are: the graph's inputs are their slots' last tokens (gathered before
    the draw rewrites them), and a replay for logits alone resets the knobs in the same copy."""
    graphs = _drawing_graphs(num_slots=6)
    assert graphs.draw is not None
    table = graphs.draw.last_tokens
    table[:6] = torch.arange(50, 56)
    pages = torch.full((6, MAX_PAGES + 2), -1, dtype=torch.int32)
    pages[:, 0] = torch.arange(6)
    slots = np.array([5, 0, 3])
    rows = DecodeRows(np.array([4, 9, 2]), np.array([20, 7, 9]), slots, table, pages, 1)
    knobs = [[1.0] * 4, [0] * 4, [0.9] * 4, [0.0] * 4, [11, 12, 13, 0], [1, 2, 3, 0]]
    tokens = graphs.run_and_draw(rows, knobs, slots.tolist())
    static = graphs.graphs[4].batch
    assert static.input_ids.tolist() == [55, 50, 53, 0]
    assert static.page_table[:, 0].tolist() == [5, 0, 3, SCRATCH]
    assert tokens.tolist() == [1011, 2012, 3013]
    assert table.tolist() == [2012, 51, 52, 3013, 54, 1011, 0]
    logits = graphs.run(rows)
    assert logits[:, 0].tolist() == [1011.0, 2012.0, 3013.0]  # the stand-in's logits: its inputs
    views = graphs.graphs[4].inputs.views[KNOBS_FROM:]
    assert views[-1].tolist() == [6] * 4 and views[4].tolist() == [0] * 4  # greedy, the scratch
