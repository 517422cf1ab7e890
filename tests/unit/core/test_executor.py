"""The executor thread: jobs run in submission order; a step's result is held back until the
step queued after it has launched (never past that step's own result), and while a step's
kernels run the next step's batch is built."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from m3serve.core import executor
from m3serve.core.executor import SWITCH_INTERVAL_S, Executor, launches_ahead
from m3serve.runtime.messages import SeqStep, StepPlan, StepResult

TIMEOUT = 10.0


def plan(step: int, sample: bool = True) -> StepPlan:
    """A step of one decode row (sampled), or of one prompt chunk that samples nothing."""
    row = SeqStep(None, 4, [0], slot=0) if sample else SeqStep([1, 2], 0, [0], sample=False)
    return StepPlan(step=step, seqs=[row])


class Steps:
    """Runs a plan by calling the hook registered for its step number, then returns its result;
    records the plans the executor asks it to build ahead."""

    def __init__(self, hold: bool = True, wait_for_plans: bool = False) -> None:
        self.hooks: dict[int, Callable[[], None]] = {}
        self.prepared: list[int] = []
        prepare = self.prepared.append
        self.executor = Executor(
            self.run, lambda p: prepare(p.step), hold=hold, wait_for_plans=wait_for_plans
        )

    def run(self, plan: StepPlan) -> StepResult:
        hook = self.hooks.get(plan.step)
        if hook is not None:
            hook()
        return StepResult(step=plan.step, slots=[], tokens=[])


@pytest.fixture(autouse=True)
def switch_interval() -> Iterator[None]:
    """An executor that holds results lowers the process's GIL switch interval: restored."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def steps() -> Iterator[Steps]:
    s = Steps()
    yield s
    s.executor.close()


def test_asynchronous_launches_lower_the_gil_switch_interval() -> None:
    sys.setswitchinterval(0.005)  # Python's default
    cpu = Steps(hold=False)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    gpu = Steps(hold=True)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.0001)  # a lower one set elsewhere stays
    third = Steps(hold=True)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    for s in (cpu, gpu, third):
        s.executor.close()


def test_a_step_result_waits_for_the_next_step_to_launch(steps: Steps) -> None:
    release_first = threading.Event()
    seen: dict[str, bool] = {}
    steps.hooks[0] = lambda: release_first.wait(TIMEOUT)
    first = steps.executor.submit(plan(0))

    def second_step() -> None:
        seen["before launch"] = first.done()
        steps.executor.while_device_runs(lambda: True)  # the runner, its kernels queued
        seen["after launch"] = first.done()

    steps.hooks[1] = second_step
    second = steps.executor.submit(plan(1))
    release_first.set()  # step 1 is queued when step 0 ends
    assert second.result(TIMEOUT).step == 1 and first.result(0).step == 0
    assert seen == {"before launch": False, "after launch": True}


@pytest.mark.parametrize(
    ("hold", "sample"), [(True, False), (False, True)], ids=["prompt-chunk-next", "cpu-no-hold"]
)
def test_a_result_is_not_held_for_a_step_that_samples_nothing_or_on_a_cpu(
    hold: bool, sample: bool
) -> None:
    """A prompt chunk with no sampled row never reports its launch, and a CPU's launch is the
    whole forward (`hold=False`): the result before such a step goes out before it runs."""
    steps = Steps(hold=hold)
    release_first = threading.Event()
    seen: dict[str, bool] = {}
    try:
        steps.hooks[0] = lambda: release_first.wait(TIMEOUT)
        first = steps.executor.submit(plan(0))
        steps.hooks[1] = lambda: seen.setdefault("at start", first.done())
        second = steps.executor.submit(plan(1, sample=sample))
        release_first.set()
        assert second.result(TIMEOUT).step == 1
    finally:
        steps.executor.close()
    assert seen == {"at start": True}


def test_a_step_with_nothing_queued_behind_it_is_handed_over_at_once(steps: Steps) -> None:
    assert steps.executor.submit(plan(0)).result(TIMEOUT).step == 0


def test_a_held_result_goes_out_before_the_next_steps_own(steps: Steps) -> None:
    """A step that never launches (no sampled rows) or fails still releases the one before
    it first, so results arrive in submission order."""
    release = threading.Event()
    order: list[int] = []
    steps.hooks[0] = lambda: release.wait(TIMEOUT)

    def fail() -> None:
        raise RuntimeError("device lost")

    steps.hooks[2] = fail
    futures = [steps.executor.submit(plan(i)) for i in range(3)]
    for i, future in enumerate(futures):
        future.add_done_callback(lambda _, i=i: order.append(i))
    release.set()
    with pytest.raises(RuntimeError, match="device lost"):
        futures[2].result(TIMEOUT)
    assert order == [0, 1, 2]


def test_the_next_step_is_built_while_the_device_runs(steps: Steps) -> None:
    """The device stays busy until step 0 has built step 1 ahead (or a deadline passes)."""
    deadline = time.monotonic() + TIMEOUT
    steps.hooks[0] = lambda: steps.executor.while_device_runs(
        lambda: bool(steps.prepared) or time.monotonic() > deadline
    )
    futures = [steps.executor.submit(plan(i)) for i in range(2)]
    assert [f.result(TIMEOUT).step for f in futures] == [0, 1]
    assert steps.prepared == [1]


@pytest.mark.parametrize("hold", [True, False], ids=["gpu", "cpu"])
def test_nothing_is_built_ahead_once_the_device_is_done(hold: bool) -> None:
    """Without --launch-ahead, and on a CPU (whose steps hold no result to hand over), a step
    whose device is done returns at once, a next step queued or not."""
    steps = Steps(hold=hold, wait_for_plans=not hold)
    try:
        release = threading.Event()
        steps.hooks[0] = lambda: release.wait(TIMEOUT)
        steps.hooks[1] = lambda: steps.executor.while_device_runs(lambda: True)
        futures = [steps.executor.submit(plan(i)) for i in range(3)]
        release.set()
        assert [f.result(TIMEOUT).step for f in futures] == [0, 1, 2]
        assert steps.prepared == []
    finally:
        steps.executor.close()


def test_with_launches_ahead_the_plan_from_a_handed_over_result_is_waited_for() -> None:
    """After handing a result over, a step waits for the plan the event loop makes from it,
    device done or not, and builds it."""
    gpu = Steps(wait_for_plans=True)
    try:
        release = threading.Event()
        gpu.hooks[0] = lambda: release.wait(TIMEOUT)
        first = gpu.executor.submit(plan(0))
        # Step 1 hands step 0's result over; "the loop" queues step 2 once it has it.
        gpu.hooks[1] = lambda: gpu.executor.while_device_runs(lambda: True)
        second = gpu.executor.submit(plan(1))
        first.add_done_callback(lambda _: gpu.executor.submit(plan(2)))
        release.set()
        assert second.result(TIMEOUT).step == 1
        assert gpu.prepared == [2]
    finally:
        gpu.executor.close()


def test_the_wait_for_the_next_plan_and_its_build_are_timed_per_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step trace's `wait=` and `ahead=`: a run that waits ~50 ms for the event loop's plan
    and builds it in ~20 ms reports about that; the run after it, which builds nothing, 0."""
    monkeypatch.setattr(executor, "_PLAN_WAIT_S", 10 * TIMEOUT)  # only the loop's word ends it
    hooks: dict[int, Callable[[], None]] = {}
    timed: dict[int, tuple[float, float]] = {}

    def run(p: StepPlan) -> StepResult:
        if p.step in hooks:
            hooks[p.step]()
        return StepResult(step=p.step, slots=[], tokens=[])

    gpu = Executor(run, lambda p: time.sleep(0.02), wait_for_plans=True)
    try:

        def ahead_and_read(step: int) -> None:
            gpu.while_device_runs(lambda: True)
            timed[step] = (gpu.plan_wait_s, gpu.ahead_s)

        release = threading.Event()
        hooks[0] = lambda: release.wait(TIMEOUT)
        hooks[1] = lambda: ahead_and_read(1)
        hooks[2] = lambda: ahead_and_read(2)
        first = gpu.submit(plan(0))
        second = gpu.submit(plan(1))
        # "The event loop" plans step 2 50 ms after it took step 0's result.
        first.add_done_callback(lambda _: threading.Timer(0.05, gpu.submit, [plan(2)]).start())
        second.add_done_callback(lambda _: gpu.nothing_planned())  # and nothing after step 2
        release.set()
        assert second.result(TIMEOUT).step == 1
    finally:
        gpu.close()
    wait, ahead = timed[1]
    assert 0.04 <= wait < 5.0 and 0.015 <= ahead < 5.0
    assert timed[2] == (0.0, 0.0)  # nothing was planned after it: no wait, nothing built


def test_a_loop_that_planned_nothing_ends_the_wait_for_its_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(executor, "_PLAN_WAIT_S", 10 * TIMEOUT)  # only the loop's word ends it
    steps = Steps(wait_for_plans=True)
    try:
        release = threading.Event()
        steps.hooks[0] = lambda: release.wait(TIMEOUT)
        first = steps.executor.submit(plan(0))
        first.add_done_callback(lambda _: steps.executor.nothing_planned())
        steps.hooks[1] = lambda: steps.executor.while_device_runs(lambda: True)
        second = steps.executor.submit(plan(1))
        release.set()
        assert second.result(TIMEOUT).step == 1
        assert steps.prepared == [] and first.done()
    finally:
        steps.executor.close()


def test_a_step_built_ahead_runs_although_its_caller_gave_up_on_it(steps: Steps) -> None:
    """Under --tp a step built ahead is in the other ranks' hands already: it runs even when
    its future was cancelled (shutting down); a step not built ahead is skipped."""
    ran: list[int] = []
    deadline = time.monotonic() + TIMEOUT
    release = threading.Event()

    def step_0() -> None:
        steps.executor.while_device_runs(
            lambda: bool(steps.prepared) or time.monotonic() > deadline
        )
        release.wait(TIMEOUT)

    steps.hooks[0] = step_0
    steps.hooks[1] = lambda: ran.append(1)
    steps.hooks[2] = lambda: ran.append(2)
    futures = [steps.executor.submit(plan(i)) for i in range(3)]
    while not steps.prepared:  # step 1 is built ahead; then the caller gives up on 1 and 2
        time.sleep(0.001)
    assert futures[1].cancel() and futures[2].cancel()
    release.set()
    futures[0].result(TIMEOUT)
    steps.executor.close()
    assert steps.prepared == [1] and ran == [1]


@pytest.mark.parametrize(
    ("setting", "asynchronous", "expected"),
    [
        ("auto", True, True),
        ("auto", False, False),
        ("on", False, True),
        ("on", True, True),
        ("off", True, False),
        ("off", False, False),
    ],
)
def test_auto_launches_ahead_only_where_launches_are_asynchronous(
    setting: str, asynchronous: bool, expected: bool
) -> None:
    assert launches_ahead(setting, asynchronous) is expected
