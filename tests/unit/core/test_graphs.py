"""The decode graphs' static inputs: after any sequence of steps of any row counts and page-table
widths, the rows a step uses hold its values and every other row holds padding (a token at
position 0 of the scratch page), although a step resets only the rows a bigger step left."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.graphs import DecodeGraphs, _Captured

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
