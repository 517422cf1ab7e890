"""The piecewise steps' draw (core/head_draw.py), run eagerly on the CPU: each sampled row's
hidden state reaches the head and its knobs the draw, the tokens reach the slots' table and
padding only the scratch slot; and an engine core whose prefill and mixed steps draw there gives
the greedy outputs it gives sampling them eagerly, with steps launched ahead and not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import M31_SPEC
from helpers.core_runs import greedy_outputs, small_cpu_core

from m3serve.core.engine_core import EngineCore
from m3serve.core.graphs import GraphDraw
from m3serve.core.head_draw import HeadDraws
from m3serve.core.piecewise import PiecewiseGraphs
from m3serve.core.sampler import DRAW_KNOBS
from m3serve.model.tiny.checkpoint import TinySpec

HIDDEN, VOCAB, SLOTS = 8, 11, 6


def _stand_in_heads(hidden: torch.Tensor, weight: torch.Tensor) -> HeadDraws:
    """Heads over a linear LM head whose draw writes argmax + 1000 x seed: a token says which
    hidden row and which knobs its row got."""

    def sample(logits: torch.Tensor, *knobs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(logits.argmax(-1) + 1000 * knobs[4])

    model: Any = SimpleNamespace(
        device=torch.device("cpu"), compute_logits=lambda h: (h @ weight.T).float()
    )
    table = torch.full((SLOTS + 1,), -7, dtype=torch.int64)
    return HeadDraws(model, hidden, GraphDraw(sample, DRAW_KNOBS, table), [1, 2, 4], False)


def _knobs(seeds: list[int], size: int) -> list[list[float]]:
    pad = size - len(seeds)
    fills = [[fill] * size for _, fill in DRAW_KNOBS]
    fills[4] = [*seeds, *([DRAW_KNOBS[4][1]] * pad)]
    return fills


def test_each_row_draws_from_its_hidden_state_with_its_knobs_into_its_slot() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    heads = _stand_in_heads(hidden, weight)
    rows = np.array([3, 17, 9])
    tokens = heads.run(rows, _knobs([4, 0, 2], heads.bucket(3)), [5, 0, 3])  # 4-row bucket
    argmax = (hidden[rows] @ weight.T).argmax(-1)
    assert tokens.tolist() == (argmax + 1000 * torch.tensor([4, 0, 2])).tolist()
    table = heads.draw.last_tokens
    assert table[[5, 0, 3]].tolist() == tokens.tolist()
    # The padding row drew from row 0 greedily, into the scratch slot only.
    assert table[SLOTS].item() == (hidden[0] @ weight.T).argmax().item()
    assert table[[1, 2, 4]].tolist() == [-7] * 3
    with pytest.raises(ValueError, match="2 slots for 3 rows"):
        heads.run(rows, _knobs([4, 0, 2], 4), [5, 0])
    assert heads.holds(4) and not heads.holds(5) and not heads.holds(0)


# Six requests on four slots: later prompts are prefilled beside running decodes (mixed steps).
PROMPTS = [[5 + i % 50 for i in range(n)] for n in (37, 9, 22, 13, 30, 5)]
OUTPUTS = [30, 12, 21, 16, 14, 9]


@pytest.fixture(scope="module", params=["on", "off"], ids=["launch-ahead", "serial"])
def core(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[TinySpec], Path]
) -> Iterator[EngineCore]:
    engine = small_cpu_core(
        tiny_checkpoint(M31_SPEC), chunked_prefill_size=16, launch_ahead=request.param
    )
    yield engine
    engine.close()


def _outputs(core: EngineCore) -> dict[str, list[int]]:
    return greedy_outputs(core, PROMPTS, OUTPUTS)


def test_steps_drawn_after_the_piecewise_graphs_give_the_eager_sampler_outputs(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = core.runner
    assert runner.piecewise is None and runner.heads is None  # a CPU captures none
    plain = _outputs(core)
    budget = core.budget
    piecewise = PiecewiseGraphs(core.model, core.kv, budget.num_pages, 64, capture=False)

    def greedy(logits: torch.Tensor, *knobs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(logits.argmax(-1))

    draw = GraphDraw(greedy, DRAW_KNOBS, runner.last_tokens)
    heads = HeadDraws(core.model, piecewise.buffers.hidden, draw, [1, 2, 4], capture=False)
    drawn: list[int] = []
    run = heads.run
    monkeypatch.setattr(heads, "run", lambda *a: drawn.append(len(a[0])) or run(*a))
    # A CPU has no device draw, so the sampler gives no graph knobs: greedy ones stand in.
    monkeypatch.setattr(runner.sampler, "graph_knobs", lambda slots, rows: _knobs([], rows))
    runner.piecewise, runner.heads = piecewise, heads
    try:
        through_heads = _outputs(core)
    finally:
        runner.piecewise = runner.heads = None
    assert through_heads == plain
    assert [len(plain[f"r{i}"]) for i in range(len(PROMPTS))] == OUTPUTS
    # Every step that carried prompt tokens drew there: each request's first token, at least.
    assert sum(drawn) >= len(PROMPTS) and max(drawn) > 1
