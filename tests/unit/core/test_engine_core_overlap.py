"""Overlap in the engine core: a step planned before the CPU saw a request's stop token runs that
request's row dead (its draw discarded), so its output is the one without overlap, and a batch
built ahead, before the stop token was sampled, is still the one that runs; a step of dead rows
alone runs no forward. With --launch-ahead on (auto leaves a CPU off) a step launched ahead
(queued before the step in flight gave its tokens back) gives the same tokens, also when a row
in it turns dead after its launch and its slot goes to a new request; steps whose rows need the
host's view of those tokens (a grammar) or read the device back (logprobs) are not launched
ahead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import M31_SPEC
from helpers.core_runs import CoreRun, run_to_end

from m3serve.core import step_ahead, step_runner
from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.core.step_runner import StepRunner
from m3serve.model.batch import ForwardBatch
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SKIPPED_TOKEN, Constraint, SamplingParams, StepResult

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def two_slots(tiny_checkpoint: Callable[[TinySpec], Path]) -> Iterator[EngineCore]:
    """A core with two request slots (a third request waits for one to free) that launches
    steps ahead."""
    path = tiny_checkpoint(M31_SPEC)
    args = ServerArgs.from_kwargs(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048,
        max_running_requests=2, launch_ahead="on",
    )  # fmt: skip
    engine = EngineCore(args, path)
    yield engine
    engine.close()


def _req(rid: str, stop_ids: frozenset[int], max_new: int = 12, logprobs: bool = False) -> Req:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, logprobs=logprobs)
    return Req(rid=rid, prompt=list(PROMPT), sampling=sampling, stop_ids=stop_ids, worker=0)


def _busy_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's "device" stays busy for a while after its launch, so the executor builds
    (and where it can, launches) the next step before this one's tokens are known."""

    def busy_for_a_while(device: object) -> object:
        until = time.monotonic() + 0.05
        return lambda: time.monotonic() > until

    monkeypatch.setattr(step_runner, "_device_done", busy_for_a_while)


def _launched_ahead(monkeypatch: pytest.MonkeyPatch) -> list[StepResult]:
    """The results of the steps whose run took the tokens of a launch ahead, in order."""
    steps: list[StepResult] = []
    finish = StepRunner._finish_ahead

    def spy(self, ahead):  # type: ignore[no-untyped-def]
        steps.append(finish(self, ahead))
        return steps[-1]

    monkeypatch.setattr(StepRunner, "_finish_ahead", spy)
    return steps


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

    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)  # none: auto launches nothing ahead on a CPU
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

    def spy_ran(step, seconds, compiles, launch=0.0, build=0.0, *usage, **more):  # type: ignore[no-untyped-def]
        built_in_run[step] = build > 0.0
        return ran_trace(step, seconds, compiles, launch, build, *usage, **more)

    monkeypatch.setattr(core.trace, "ran", spy_ran)
    _stopping_beside_running(core, greedy, stop, ends_at)

    assert sum(row.count(0) for row in ran) == ends_at  # the last one dead
    assert any(used_ahead)  # steps ran on batches built ahead
    # The trace's `build=` is 0 exactly for the steps that ran a batch built ahead.
    assert {step: not ahead for step, ahead in ahead_by_step.items()} == {
        step: built_in_run[step] for step in ahead_by_step
    }
    assert len(built) == len(ran)  # and none was built again: not the one "stopping" ended in
    assert ahead == []
    core.scheduler.idle_check()


def test_steps_launched_ahead_give_the_serial_tokens(
    two_slots: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests through two slots under a busy device: "stopping" ends on a stop token
    while the step after is already launched (its row there runs dead, the draw discarded),
    then "third" takes its slot; each gets its serial greedy tokens."""
    greedy, stop, ends_at = _stop_token(two_slots, 3)
    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)
    reqs = [_req("stopping", frozenset({stop})), _req("running", frozenset()),
            _req("third", frozenset(), 8)]  # fmt: skip
    ran: list[int] = []
    run = StepRunner.run

    def spy_run(self, plan, layers=None):  # type: ignore[no-untyped-def]
        ran.append(plan.step)
        return run(self, plan, layers)

    monkeypatch.setattr(StepRunner, "run", spy_run)
    out = _generate(two_slots, reqs, overlap=True)

    assert out == {"stopping": greedy[:ends_at], "running": greedy, "third": greedy[:8]}
    assert [r.step for r in ahead] == ran[1:]  # all but the first: none in flight before it
    # The row "stopping" ran after its stop token came back dead, though launched live.
    rows = [(slot, t) for r in ahead for slot, t in zip(r.slots, r.tokens, strict=True)]
    skipped = [slot for slot, token in rows if token == SKIPPED_TOKEN]
    assert skipped == [0]
    two_slots.scheduler.idle_check()


def test_an_abort_beside_steps_launched_ahead_frees_its_pages_and_slot(
    two_slots: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request aborted while the step after it is already launched ahead (its row live
    there): the others get their serial tokens, the third one in the freed slot too, and every
    page comes back."""
    greedy, _, _ = _stop_token(two_slots, 3)
    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)
    reqs = [_req("aborted", frozenset()), _req("running", frozenset()),
            _req("third", frozenset(), 8)]  # fmt: skip

    def abort(run: CoreRun) -> None:
        if len(run.outputs["aborted"]) >= 3:
            two_slots.abort("aborted")

    out = run_to_end(two_slots, reqs, overlap=True, after_step=abort).outputs

    assert ahead
    assert out["running"] == greedy and out["third"] == greedy[:8]
    assert 3 <= len(out["aborted"]) < len(greedy)
    assert out["aborted"] == greedy[: len(out["aborted"])]
    two_slots.scheduler.idle_check()
    two_slots.scheduler.cache.reset()
    assert two_slots.scheduler.pool.num_free == two_slots.scheduler.pool.num_pages


def test_a_step_with_a_logprobs_row_is_not_launched_ahead(
    two_slots: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logprobs are read back as they are drawn: launched ahead, the step would wait for its
    own tokens inside the step before it."""
    greedy, _, _ = _stop_token(two_slots, 3)
    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)
    out = _generate(two_slots, [_req("logprobs", frozenset(), logprobs=True)], overlap=True)

    assert out["logprobs"] == greedy
    assert ahead == []
    two_slots.scheduler.idle_check()


def test_a_step_with_a_grammar_row_is_not_launched_ahead(
    two_slots: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar's mask for a step takes the tokens of the step before, on the host: launched
    ahead, the step would draw under a stale mask."""

    def constrained(rid: str) -> Req:
        req = _req(rid, frozenset(), max_new=8)
        req.sampling.constraint = Constraint("json_object")
        return req

    serial = _generate(two_slots, [constrained("serial")], overlap=False)["serial"]
    two_slots.scheduler.cache.reset()
    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)
    out = _generate(two_slots, [constrained("overlap")], overlap=True)

    assert out["overlap"] == serial and serial
    assert ahead == []
    two_slots.scheduler.idle_check()


SPAN_S = 0.123  # what every fake device span took


class _Span:
    """A step's device span (core/device_clock.py) that took SPAN_S once stopped."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def seconds(self) -> float | None:
        return SPAN_S if self.stopped else None


class _Budget:
    """The mixed-step budget's feed: the ms of each step run, and its decode rows and the
    batch its budget was sized for."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.rows: list[tuple[int, int]] = []

    def observe(self, decodes: int, prompt_tokens: int, ms: float, sized_for: int = 0) -> None:
        self.ms.append(ms)
        self.rows.append((decodes, sized_for))


def _device_spans(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> _Budget:
    """Every step gets a device span as on a GPU, and the budget's feed is recorded."""
    for module in (step_runner, step_ahead):  # a step's run, and a step launched ahead
        monkeypatch.setattr(module, "start_span", lambda device: _Span())
    budget = _Budget()
    monkeypatch.setattr(core, "served_budget", budget)
    return budget


@pytest.mark.parametrize("launched_ahead", [False, True], ids=["in-run", "ahead"])
def test_the_mixed_step_budget_is_fed_each_steps_device_time(
    core: EngineCore, two_slots: EngineCore, launched_ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step launched ahead may have run in part before its run began, so the budget takes
    its kernels' device span, not the run's wall time, whether launched ahead or in its run."""
    engine = two_slots if launched_ahead else core
    _busy_device(monkeypatch)
    ahead = _launched_ahead(monkeypatch)
    budget = _device_spans(engine, monkeypatch)
    _generate(engine, [_req("a", frozenset(), max_new=6)], overlap=True)

    assert bool(ahead) == launched_ahead
    assert len(budget.ms) == 6  # the prefill, then five decode steps
    assert budget.ms == [pytest.approx(SPAN_S * 1e3)] * 6
    engine.scheduler.idle_check()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_each_step_feeds_back_the_batch_its_budget_was_planned_for(
    core: EngineCore, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler sizes a mixed step's budget for a batch (`_batch_ahead`) when it plans
    the step; the run that feeds its time back, a step later under overlap, passes that batch
    on, and steps without decode rows pass none."""
    budget = _device_spans(core, monkeypatch)
    monkeypatch.setattr(core.scheduler, "mixed_budget", lambda rows: 64)
    monkeypatch.setattr(core.scheduler, "_batch_ahead", lambda decodes: decodes + 5)
    _generate(core, [_req("a", frozenset(), max_new=4), _req("b", frozenset(), max_new=3)], overlap)

    assert budget.rows[0] == (0, 0)  # the prefills: nothing decodes, no mixed budget
    assert len(budget.rows) > 1
    assert all(sized_for == decodes + 5 for decodes, sized_for in budget.rows[1:])
    assert core._budget_rows == {}


def test_the_next_step_is_launched_before_the_last_steps_result_is_taken(
    two_slots: EngineCore,
) -> None:
    """`overlap_step(launched)` awaits `launched` (where the scheduler actor sends the outputs
    the call before returned) with the new step in flight and the step before it not yet
    processed: its tokens are not on the host yet."""
    req = _req("solo", frozenset(), max_new=5)
    seen: list[tuple[int | None, int]] = []  # at `launched`: the step in flight, host tokens

    async def launched() -> None:
        in_flight = two_slots._in_flight
        seen.append((in_flight[0] if in_flight is not None else None, len(req.output)))

    async def go() -> list[int]:
        two_slots.add(req)
        counts = []
        while two_slots.has_work or two_slots._in_flight is not None:
            await two_slots.overlap_step(launched)
            counts.append(len(req.output))
        return counts

    counts = asyncio.run(go())
    assert counts[-1] == 5 and len(seen) == len(counts)
    steps = [step for step, _ in seen if step is not None]
    assert len(steps) >= 5 and steps == sorted(set(steps))  # each call launched a new step
    # At each `launched` the host holds what the call before returned, not this call's tokens.
    assert [tokens for _, tokens in seen] == [0, *counts[:-1]]
