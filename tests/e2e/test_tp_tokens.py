"""How the follower ranks learn each step's tokens without speculation, on two gloo ranks: they
draw none and read none back; rank 0's sampled tokens reach them on the device as their next
decode inputs. The rows of requests that ended on the step before (the overlap loop planned them
before the stop token was seen) run dead on every rank, so rank 0 sends a plan as it builds its
batch ahead, before the step before it has ended. Sampled requests (rank 0's draws, which the
followers could not have made) and a request that ends on a stop token run to the end, every
follower step on rank 0's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.core_ranks import ReqSpec, built_ahead_job, core_args, drive, run_cores, waves_job

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


def _requests(path: Path) -> tuple[list[ReqSpec], list[int], int]:
    """A request that stops on a token of its greedy output, beside two sampled ones; the
    greedy output (`--tp 1`) and where the stop token is in it."""
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
    return specs, want, at


@pytest.mark.slow
def test_followers_run_on_rank_0s_tokens_and_the_rows_it_ended_run_dead(path: Path) -> None:
    specs, want, at = _requests(path)
    per_rank = run_cores(2, path, {}, waves_job, [specs])
    (runs, baseline), leader_ran, _ = per_rank[0]
    followed, follower_ran, _ = per_rank[1]
    outputs = runs[0].outputs
    assert outputs["stopped"] == want[: at + 1]
    assert len(outputs["drawn"]) == len(outputs["drawn again"]) == 8
    # Every step the follower ran took rank 0's tokens as its next inputs, drawn ones too.
    assert follower_ran == leader_ran
    assert followed.steps == len(leader_ran)
    assert baseline


@pytest.mark.slow
def test_rank_0_sends_a_plan_when_it_builds_the_batch_ahead(path: Path) -> None:
    specs, want, at = _requests(path)
    per_rank = run_cores(2, path, {}, built_ahead_job, specs)
    (run, sent), leader_ran, _ = per_rank[0]
    followed, follower_ran, _ = per_rank[1]
    assert sent and all(sent)  # each plan built ahead was in the followers' hands first
    assert run.outputs["stopped"] == want[: at + 1]
    assert len(run.outputs["drawn"]) == len(run.outputs["drawn again"]) == 8
    assert follower_ran == leader_ran
    assert followed.steps == len(leader_ran)
