"""Overlap in the engine core: a step planned before the CPU saw a request's stop token runs that
request's row dead (its draw discarded), so its output is the one without overlap, and a batch
built ahead, before the stop token was sampled, is still the one that runs; a step of dead rows
alone runs no forward."""

from __future__ import annotations

import time

import pytest
from helpers.core_runs import run_to_end

from m3serve.core import step_runner
from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.core.step_runner import StepRunner
from m3serve.model.batch import ForwardBatch
from m3serve.runtime.messages import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _req(rid: str, stop_ids: frozenset[int], max_new: int = 12) -> Req:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return Req(rid=rid, prompt=list(PROMPT), sampling=sampling, stop_ids=stop_ids, worker=0)


def _generate(core: EngineCore, reqs: list[Req], overlap: bool) -> dict[str, list[int]]:
    return run_to_end(core, reqs, overlap=overlap).outputs


def _decode_rows(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The slots of the decode rows of every forward the engine core builds."""
    rows: list[list[int]] = []
    build = ForwardBatch.build

    def spy(seqs, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append([s.slot for s in seqs if s.input_ids is None])
        return build(seqs, *args, **kwargs)

    monkeypatch.setattr(ForwardBatch, "build", spy)
    return rows


def _stop_token(core: EngineCore, index: int) -> tuple[list[int], int, int]:
    """The greedy output of the prompt, its token at `index` as a stop token, and how many
    tokens a request that stops on it gets (the stop token is its last)."""
    greedy = _generate(core, [_req("probe", frozenset())], overlap=False)["probe"]
    stop = greedy[index]
    core.scheduler.cache.reset()
    return greedy, stop, greedy.index(stop) + 1


def _stopping_beside_running(core: EngineCore, greedy: list[int], stop: int, ends_at: int) -> None:
    """Two requests under overlap, one stopping on `stop`: both get the serial greedy tokens.
    Slots are handed out lowest first, in arrival order: "stopping" decodes in slot 0."""
    stopping, running = _req("stopping", frozenset({stop})), _req("running", frozenset(), 12)
    out = _generate(core, [stopping, running], overlap=True)
    assert out["stopping"] == greedy[:ends_at]
    assert out["running"] == greedy


def test_a_request_ending_on_a_stop_token_gets_no_token_after_it(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy, stop, ends_at = _stop_token(core, 3)
    rows = _decode_rows(core, monkeypatch)
    _stopping_beside_running(core, greedy, stop, ends_at)
    # One prefill step samples the first token, one decode row each later token; then the row
    # planned before the stop token was seen runs dead, and its draw reaches nobody.
    assert sum(row.count(0) for row in rows) == ends_at
    core.scheduler.idle_check()


def test_a_step_whose_every_row_ended_runs_no_forward(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy, stop, ends_at = _stop_token(core, 2)
    rows = _decode_rows(core, monkeypatch)
    out = _generate(core, [_req("alone", frozenset({stop}))], overlap=True)

    assert out["alone"] == greedy[:ends_at]
    assert len(rows) == ends_at  # the prefill and one decode per later token
    core.scheduler.idle_check()


def test_a_batch_built_ahead_runs_although_a_request_in_it_ended_meanwhile(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's "device" stays busy for a while, so the executor builds the next step's
    batch before this step's tokens are known; when one of them is a stop token, that batch
    still runs, the ended request's row in it dead."""
    greedy, stop, ends_at = _stop_token(core, 3)

    def busy_for_a_while(device: object) -> object:
        until = time.monotonic() + 0.05
        return lambda: time.monotonic() > until

    monkeypatch.setattr(step_runner, "_device_done", busy_for_a_while)
    ran: list[list[int]] = []  # the slots of the decode rows of each forward that ran
    used_ahead: list[bool] = []
    with_media, take = StepRunner._with_media, StepRunner._take_prepared

    def spy_run(self, plan, seqs, batch):  # type: ignore[no-untyped-def]
        ran.append([s.slot for s in seqs if s.input_ids is None])
        return with_media(self, plan, seqs, batch)

    ahead_by_step: dict[int, bool] = {}

    def spy_take(self, step, seqs):  # type: ignore[no-untyped-def]
        batch = take(self, step, seqs)
        used_ahead.append(batch is not None)
        ahead_by_step[step] = batch is not None
        return batch

    monkeypatch.setattr(StepRunner, "_with_media", spy_run)
    monkeypatch.setattr(StepRunner, "_take_prepared", spy_take)
    built = _decode_rows(core, monkeypatch)
    built_in_run: dict[int, bool] = {}  # by step: whether the trace got a `build=` time
    ran_trace = core.trace.ran

    def spy_ran(step, seconds, compiles, launch=0.0, build=0.0, *usage):  # type: ignore[no-untyped-def]
        built_in_run[step] = build > 0.0
        return ran_trace(step, seconds, compiles, launch, build, *usage)

    monkeypatch.setattr(core.trace, "ran", spy_ran)
    _stopping_beside_running(core, greedy, stop, ends_at)

    assert sum(row.count(0) for row in ran) == ends_at  # the last one dead
    assert any(used_ahead)  # steps ran on batches built ahead
    # The trace's `build=` is 0 exactly for the steps that ran a batch built ahead.
    assert {step: not ahead for step, ahead in ahead_by_step.items()} == {
        step: built_in_run[step] for step in ahead_by_step
    }
    assert len(built) == len(ran)  # and none was built again: not the one "stopping" ended in
    core.scheduler.idle_check()
