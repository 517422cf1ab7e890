"""How the follower ranks learn each step's tokens without speculation, on two gloo ranks: they
draw none and read none back; rank 0's sampled tokens reach them on the device as their next
decode inputs, and rank 0 leaves out of the plans it sends the rows whose requests ended on the
step before (the overlap loop planned them before the stop token was seen). Sampled requests
(rank 0's draws, which the followers could not have made) and a request that ends on a stop
token run to the end, every follower step on rank 0's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.core_ranks import ReqSpec, core_args, drive, run_cores, waves_job

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams

SPEC = TinySpec(dtype="float32", seed=5)
PROMPT = tuple(range(3, 40))
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
DRAWN = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


def first_new(tokens: list[int]) -> int:
    """The index of the first token after the first that the ones before it do not hold."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.slow
def test_followers_run_on_rank_0s_tokens_and_skip_the_rows_it_ended(path: Path) -> None:
    reference = EngineCore(core_args(path), path)
    try:
        greedy = drive(reference, [ReqSpec("probe", prompt=PROMPT, sampling=GREEDY)]).outputs
    finally:
        reference.close()
    want = greedy["probe"]
    at = first_new(want)
    specs = [
        ReqSpec("stopped", prompt=PROMPT, sampling=GREEDY, stop_ids=(want[at],)),
        ReqSpec("drawn", prompt=(4, 8, 15, 16, 23, 42), sampling=DRAWN),
        ReqSpec("drawn again", prompt=(7, 7, 9), sampling=DRAWN),
    ]
    per_rank = run_cores(2, path, {}, waves_job, [specs])
    (runs, baseline), leader_ran, _ = per_rank[0]
    followed, follower_ran, _ = per_rank[1]
    outputs = runs[0].outputs
    assert outputs["stopped"][:at] == want[:at] and len(outputs["stopped"]) <= at + 1
    assert len(outputs["drawn"]) == len(outputs["drawn again"]) == 8
    # Every step the follower ran took rank 0's tokens as its next inputs, drawn ones too.
    assert follower_ran == leader_ran
    assert followed.steps == len(leader_ran)
    assert baseline
