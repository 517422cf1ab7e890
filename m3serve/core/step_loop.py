"""StepLoop: the engine core's requests and steps, over a scheduler and the executor thread.

`step()` reads schedule → run → process; `overlap_step()` is the same three phases with step
N+1 launched before step N is processed, so the host work of one step hides behind the device
work of the other. `run()` is the only place the model is called; it executes on the executor
thread, everything else on the event loop that owns the core.

`EngineCore` (core/engine_core.py) builds the parts this loop steps; a model-less core (the
scheduler benchmark) sets them itself. With tensor parallelism (`plans`), each plan goes to the
followers once: when the executor builds its batch ahead (`prepare`, while the step before it
runs), so that they build and queue it behind that step on their devices too, else when it runs;
either way before rank 0 runs it. Since the ranks run in lockstep a failed step is fatal to the
engine (raised, not failed request by request)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from m3serve.core.executor import Executor
from m3serve.core.media import ReqMedia
from m3serve.core.mixed_budget import MixedBudget
from m3serve.core.ranks import PlanChannel
from m3serve.core.req import Req
from m3serve.core.scheduler import Outputs, Scheduler
from m3serve.core.step_inputs import StepInputs
from m3serve.core.step_runner import StepRunner
from m3serve.core.trace import StepTrace, thread_usage
from m3serve.runtime.messages import StepPlan, StepResult

Launched = tuple[int, "asyncio.Future[StepResult]"]  # a step submitted to the executor


class StepLoop:
    scheduler: Scheduler
    inputs: StepInputs
    runner: StepRunner
    executor: Executor
    trace: StepTrace
    served_budget: MixedBudget | None = None  # the mixed-step budget, fed each step's time
    # Step -> the decode batch its prompt budget was sized for (`Scheduler.mixed_rows`), from
    # planning to the run that feeds the step's time back (with `served_budget` only).
    _budget_rows: dict[int, int]
    plans: PlanChannel | None  # rank 0 of a tensor-parallel group: the followers' plans
    _sent: int | None = None  # the step whose plan went to the followers last
    _in_flight: Launched | None  # the step launched and not yet processed (overlap)

    # ------------------------------------------------------------------ requests

    def add(self, req: Req, fit_to_pool: bool = False) -> None:
        self.inputs.add(self.scheduler, req, fit_to_pool)

    def abort(self, rid: str) -> None:
        self.inputs.abort(rid)
        self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.inputs.waiting or self.scheduler.has_work

    @property
    def _step_media(self) -> dict[int, dict[int, list[ReqMedia]]]:
        """The images handed to planned steps that have not run yet (empty when idle)."""
        return self.inputs.step_media

    # ------------------------------------------------------------------ steps

    async def step(self) -> Outputs | None:
        """Schedule → run → process one step; None when there was nothing to run."""
        plan = self._schedule()
        if plan is None:
            return self.scheduler.take_errors()
        outputs = await self._process(self._launch(plan))
        self.trace.log_processed()
        return outputs

    async def overlap_step(
        self, launched: Callable[[], Awaitable[None]] | None = None
    ) -> Outputs | None:
        """Schedule and launch step N+1, then process step N, whose tokens the plan of step N+1
        never needed (decode inputs come from the slot table). None when nothing was planned
        and nothing was in flight.

        `launched` is awaited once step N+1 is launched, before step N's result is awaited:
        the caller sends step N-1's outputs there. From step N-1's result to the plan of step
        N+1 the executor may be waiting for that plan, to build it while step N runs; sending
        first (or logging the step trace) would put the sockets' writes, which let go of the
        GIL and take it back behind the executor, on that path."""
        plan = self._schedule()
        previous = self._in_flight
        self._in_flight = self._launch(plan) if plan is not None else None
        if plan is None:  # the executor may be waiting for this plan (core/executor.py)
            self.executor.nothing_planned()
        self.trace.log_processed()
        if launched is not None:
            await launched()
        if previous is None:
            return self.scheduler.take_errors() if plan is None else Outputs()
        return await self._process(previous)

    async def drain(self) -> Outputs | None:
        """Process the step still in flight, if any (before shutting down)."""
        previous, self._in_flight = self._in_flight, None
        outputs = await self._process(previous) if previous is not None else None
        self.trace.log_processed()
        return outputs

    def _schedule(self) -> StepPlan | None:
        started = time.perf_counter()
        if self.inputs.waiting:
            self.inputs.queue_compiled(self.scheduler)
        plan = self.scheduler.schedule()
        if plan is not None:
            self.inputs.keep(plan, self.scheduler.running)
            seconds = time.perf_counter() - started
            rows = self.scheduler.mixed_rows
            self.trace.planned(plan, seconds, self.scheduler.mixed_limit, rows)
            if self.served_budget is not None and rows:
                self._budget_rows[plan.step] = rows
        return plan

    def _launch(self, plan: StepPlan) -> Launched:
        return plan.step, asyncio.wrap_future(self.executor.submit(plan))

    async def _process(self, launched: Launched) -> Outputs:
        step, future = launched
        try:
            result = await future
        except Exception as exc:
            self.trace.processed(step, 0.0)
            if self.plans is not None:
                raise  # the ranks are out of step: the engine cannot go on
            return self.scheduler.fail_step(step, repr(exc))
        started = time.perf_counter()
        outputs = self.scheduler.process(result)
        self.trace.processed(step, time.perf_counter() - started)
        return outputs

    # ------------------------------------------------------------------ run (executor thread)

    def prepare(self, plan: StepPlan) -> None:
        """Executor thread, while the step before `plan` still runs: hand `plan` to the followers
        now (it is final: rows of requests that end meanwhile run dead on every rank), then
        build its batch. Not with speculation: its host token share comes after this point."""
        if self.plans is not None and self.runner.spec is None:
            self._send(plan)
        self.runner.prepare(plan)

    def run(self, plan: StepPlan) -> StepResult:
        """One forward over the plan's tokens, and a sampled token for each seq that asks."""
        started, compiles = time.perf_counter(), self.trace.compiles.count
        sized_for = self._budget_rows.pop(plan.step, 0) if self.served_budget is not None else 0
        cpu, switches = thread_usage()
        if self.plans is not None and self._sent != plan.step:  # the followers run it with us
            self._send(plan)
        self.runner.launched_at = 0.0
        result = self.runner.run(plan)
        seconds = time.perf_counter() - started
        launched = self.runner.launched_at
        launch = launched - started if launched else 0.0
        launch_cpu = self.runner.launched_cpu - cpu if launched else 0.0
        preempted = thread_usage()[1] - switches
        device = self.runner.device_seconds
        self.trace.ran(
            plan.step,
            seconds,
            compiles,
            launch,
            self.runner.build_seconds,
            launch_cpu,
            preempted,
            device or 0.0,
            ahead=(self.executor.plan_wait_s, self.executor.ahead_s),
        )
        if self.served_budget is not None:
            # The step's device time where known: a step launched ahead may have run in part
            # before its run began (core/device_clock.py).
            _feed(self.served_budget, plan, seconds if device is None else device, sized_for)
        return result

    def _send(self, plan: StepPlan) -> None:
        assert self.plans is not None
        self.plans.send(plan)
        self._sent = plan.step


def _feed(budget: MixedBudget, plan: StepPlan, seconds: float, sized_for: int = 0) -> None:
    """A step's run time, for the mixed-step budget: plain decode rows and prompt tokens only
    (a verify row's drafts make its step a different one; a load-back adds copies).
    `sized_for`: the decode batch its budget was sized for (0: its own rows)."""
    if plan.loads or any(seq.draft for seq in plan.seqs):
        return
    decodes = sum(seq.input_ids is None for seq in plan.seqs)
    prompt = sum(seq.extend for seq in plan.seqs if seq.input_ids is not None)
    budget.observe(decodes, prompt, 1e3 * seconds, sized_for)
