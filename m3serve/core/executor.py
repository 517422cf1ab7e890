"""The executor: one background thread that runs the engine core's steps in submission order.

The event loop plans and processes; the forward runs here, so on the CPU backend the overlap of
host work and "device" work is real, and on a GPU a step's host syncs never block the loop.
Plans (and other jobs, such as HiCache backups) run strictly in order, so a page freed after
step N and reused by step N+2 is never written by a step that is still in flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from m3serve.runtime.messages import StepPlan, StepResult

log = logging.getLogger(__name__)

T = TypeVar("T")
Run = Callable[[StepPlan], StepResult]
# What to run, where its result goes, and a label for the log.
Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]", str]


class Executor:
    def __init__(self, run: Run) -> None:
        self._run = run
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="m3serve-executor", daemon=True)
        self._thread.start()

    def submit(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        return self.call(lambda: self._run(plan), f"step {plan.step}")

    def call(self, fn: Callable[[], T], what: str) -> concurrent.futures.Future[T]:
        """Run `fn` on the executor thread after everything submitted before it (a HiCache
        backup must follow the steps that write the pages it copies)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future, what))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future, what = item
            if not future.set_running_or_notify_cancel():
                continue  # the scheduler gave up on this step (shutting down)
            try:
                future.set_result(fn())
            except BaseException as exc:  # the scheduler decides what a failed step means
                log.exception("%s failed", what)
                future.set_exception(exc)

    def close(self) -> None:
        """Finish the steps already submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)
