"""The start-up passes that GPU ranks run before ready — the warm-up over every step-shape
class and the step-cost timing — on two real ranks (gloo, one engine core each): they end on
both ranks (every forward's collectives pair up, no rank waits alone), the follower samples
exactly rank 0's warm-up tokens, and what is served after them equals --tp 1's greedy tokens
(the warm-up's garbage KV and sampler slots leave no trace)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.core_ranks import ReqSpec, core_args, drive, run_cores, waves_job
from helpers.startup_jobs import (
    KWARGS,
    shared_record_dir,
    warm_up_and_time,
    warm_up_from_one_record,
)

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams

SPEC = TinySpec(dtype="float32", seed=3)


def requests() -> list[ReqSpec]:
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    return [
        ReqSpec("long", prompt=tuple(range(3, 60)), sampling=sampling),
        ReqSpec("short", prompt=(5, 9, 11), sampling=sampling),
    ]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.mark.slow
def test_warm_up_and_step_timing_run_in_step_on_two_ranks(path: Path) -> None:
    reference = EngineCore(core_args(path, **KWARGS), path)
    try:
        want = drive(reference, requests()).outputs
    finally:
        reference.close()
    per_rank = run_cores(2, path, KWARGS, waves_job, [requests()], setup=warm_up_and_time)
    (runs, _), leader_ran, _ = per_rank[0]
    followed, follower_ran, _ = per_rank[1]
    assert runs[0].outputs == want
    assert all(len(ids) == 6 for ids in want.values())
    warm = [step for step, _, _ in leader_ran if step < 0]  # warm-up plans count down from -1
    assert len(warm) > 50
    assert follower_ran == leader_ran  # the warm-up's steps and tokens too
    assert followed.steps == len(leader_ran) - len(warm)


@pytest.mark.slow
def test_ranks_warm_up_from_one_record(path: Path) -> None:
    """Rank 0 records the union of both ranks' plans; a restart runs them on both ranks; ranks
    that do not hold the same record all run the whole pass (assertions in the setup)."""
    try:
        run_cores(2, path, KWARGS, waves_job, [requests()[:1]], setup=warm_up_from_one_record)
    finally:  # the ranks' shared directory is named after their parent: this process
        shutil.rmtree(shared_record_dir(os.getpid()), True)
