"""The executor: one background thread that runs the engine core's steps in submission order.

The event loop plans and processes; the forward runs here, so on the CPU backend the overlap of
host work and "device" work is real, and on a GPU a step's host syncs never block the loop.
Plans (and other jobs, such as HiCache backups) run strictly in order, so a page freed after
step N and reused by step N+2 is never written by a step that is still in flight.

While a step's kernels run, this thread does what the next step needs before its launch
(`while_device_runs`, which a step that samples calls once its kernels are queued):
- the previous step's result, held back until now, goes to the event loop, which then
  processes it while the device works and this thread waits without the GIL (handed over at
  once, the loop's work ran while this thread built and launched the next step: both need the
  GIL, and the device sat idle meanwhile). Not on a CPU (`hold`), whose launch is the forward;
- once the event loop has queued the next step, its batch is built (`prepare`), and where
  steps are launched ahead (`launches_ahead`: by default where launches are asynchronous) the
  step is launched there too where it can be (core/step_runner.py), so that
  after this step's tokens arrive little or nothing is left; under --tp its plan also goes to
  the follower ranks there, so a step handed to `prepare` runs even if its caller gives up on
  it (the other ranks will run it, and wait for this one at its collectives). With steps
  launched ahead (`wait_for_plans`), a result handed over here is what the event loop plans
  the step after next from, so that plan is waited for even once the device is done (launching
  it then costs what finishing this step first would, and it is then launched ahead of the
  step after it: otherwise, where planning takes longer than a step, every other step launched
  late), until the loop says it planned nothing (`nothing_planned`) or `_PLAN_WAIT_S` passes.

Where launches are asynchronous, the process's GIL switch interval drops from Python's 5 ms to
`SWITCH_INTERVAL_S`: each kernel launch lets go of the GIL, and when the event loop took it
meanwhile this thread waited until the loop blocked or the interval ran out (on an H200 serving
the 4-layer slice: decode steps of 64 rows ran 2.87 ms served against 2.27 on an idle device;
at 0.5 ms, 2.29 ms, and output tokens/s rose 13-14 % at concurrency 16 and 64).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from m3serve.runtime.messages import StepPlan, StepResult

log = logging.getLogger(__name__)

T = TypeVar("T")
Run = Callable[[StepPlan], StepResult]
Prepare = Callable[[StepPlan], None]
# What to run, where its result goes, a label for the log, and the plan if it is a step.
Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]", str, StepPlan | None]
# How long to wait at a time for the next step to be queued while the device runs.
_POLL_S = 0.0002
# How long a handed-over result's next plan is waited for once the device is done (a bound only:
# the event loop plans right after taking the result, or says it planned nothing).
_PLAN_WAIT_S = 0.005
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval where launches are asynchronous (above)


def launches_ahead(setting: str, asynchronous: bool) -> bool:
    """Whether steps are launched ahead (--launch-ahead `setting`: auto, on or off), where
    launches are `asynchronous` or not. auto: only where they are; a CPU computes a step's
    forward in its launch, so a step launched ahead there would hold back the result of the
    step before it by a whole forward."""
    return setting == "on" or (setting == "auto" and asynchronous)


class Executor:
    def __init__(
        self,
        run: Run,
        prepare: Prepare | None = None,
        hold: bool = True,
        wait_for_plans: bool = False,
    ) -> None:
        """`hold`: whether a step's result waits for the next step's launch (above). Only
        where launches are asynchronous: a CPU computes a step's forward in its launch, so a
        held result would wait a whole step (the built-in tiny model, 2 cores: 6 ms a token).
        `wait_for_plans`: whether the plan made from a result handed over is waited for once
        the device is done (above; with steps launched ahead, --launch-ahead)."""
        self._run = run
        self._prepare = prepare
        self._hold = hold
        self._wait_for_plans = wait_for_plans
        if hold and sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        # A finished step's result, held until the step after it has launched.
        self._pending: tuple[concurrent.futures.Future[Any], Any] | None = None
        self._prepared: StepPlan | None = None  # the last plan handed to `prepare`
        # Set by the event loop when it planned nothing after the last result handed over.
        self._nothing_planned = threading.Event()
        # The running job's `while_device_runs`, for the step trace: seconds from the hand-over
        # (or its start) to the next step's plan, and building or launching that step.
        self.plan_wait_s = 0.0
        self.ahead_s = 0.0
        self._thread = threading.Thread(target=self._work, name="m3serve-executor", daemon=True)
        self._thread.start()

    def submit(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self._put(lambda: self._run(plan), f"step {plan.step}", plan)

    def call(self, fn: Callable[[], T], what: str) -> concurrent.futures.Future[T]:
        """Run `fn` on the executor thread after everything submitted before it (a HiCache
        backup must follow the steps that write the pages it copies)."""
        return self._put(fn, what, None)

    def while_device_runs(self, done: Callable[[], bool]) -> None:
        """Executor thread, from a step whose kernels are queued (`done`: whether the device has
        finished them): hand over the previous step's result, then wait for the next step to be
        queued and build (or launch) it, while the device is busy or, after a result went out,
        until the event loop has planned from it (above)."""
        handed_over = self._publish_pending() and self._wait_for_plans
        if self._prepare is None:
            return
        started = time.perf_counter()
        deadline = time.monotonic() + _PLAN_WAIT_S
        while not done() or (
            handed_over and not self._nothing_planned.is_set() and time.monotonic() < deadline
        ):
            plan = self._next_step()
            if plan is not None:
                self._prepared = plan
                found = time.perf_counter()
                self.plan_wait_s = found - started
                try:
                    self._prepare(plan)
                except Exception:  # the step builds its batch itself, and fails there if it must
                    log.exception("building step %d ahead failed", plan.step)
                self.ahead_s = time.perf_counter() - found
                return
            with self._queue.not_empty:
                if not self._queue.queue:
                    self._queue.not_empty.wait(_POLL_S)

    def nothing_planned(self) -> None:
        """Event loop: it planned no step after taking the last result (see above)."""
        self._nothing_planned.set()

    def _put(
        self, fn: Callable[[], T], what: str, plan: StepPlan | None
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future, what, plan))
        return future

    def _publish_pending(self) -> bool:
        """Hand over the held result, if any; whether there was one."""
        if self._pending is None:
            return False
        future, result = self._pending
        self._pending = None
        self._nothing_planned.clear()  # the event loop plans again from this result
        future.set_result(result)
        return True

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future, what, plan = item
            self.plan_wait_s = self.ahead_s = 0.0
            if not future.set_running_or_notify_cancel():
                self._publish_pending()
                if plan is None or plan is not self._prepared:
                    continue  # the scheduler gave up on this step (shutting down)
                future = concurrent.futures.Future()  # it runs; nobody takes its result
                future.set_running_or_notify_cancel()
            try:
                result = fn()
            except BaseException as exc:  # the scheduler decides what a failed step means
                log.exception("%s failed", what)
                self._publish_pending()  # results go out in submission order
                future.set_exception(exc)
                continue
            self._publish_pending()  # a job that launched nothing never handed it over
            if self._hold and plan is not None and _samples(self._next_step()):
                self._pending = (future, result)
            else:
                future.set_result(result)
        self._publish_pending()

    def _next_step(self) -> StepPlan | None:
        """The plan of the next job, if one is queued and is a step."""
        with self._queue.mutex:
            waiting = self._queue.queue
            return waiting[0][3] if waiting and waiting[0] is not None else None

    def close(self) -> None:
        """Finish the steps already submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)


def _samples(plan: StepPlan | None) -> bool:
    """Whether a queued step samples a row, and so calls `while_device_runs` once its kernels
    are queued (StepRunner.launched): only then is holding the result before it worth it; a
    step without one (prompt chunks only) would keep it until the step ends."""
    return plan is not None and any(seq.sample for seq in plan.seqs)
