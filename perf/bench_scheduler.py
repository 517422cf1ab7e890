"""Scheduler CPU time per step, and how much of the host work the overlap loop hides.

Part 1 (CPU per step): the real `Scheduler` with N running decode requests and a no-op
executor; the time of `schedule()` + `process()` per step, at 64 and 256 running requests.

Part 2 (overlap): the real `SchedulerActor` step loop around an `EngineCore`, overlap schedule
on and off, whose `run` takes a fixed "device" time (a sleep that releases the GIL, as a GPU
step would). Part 3: the same with the real engine core on the CPU reference backend (the
built-in tiny model), where "device" time is the measured time inside `EngineCore.run`.
Without overlap a step costs device time + the host work around it (plan, hand-off, process,
emit); hidden share = 1 - (step_overlap - device) / (step_no_overlap - device). Prints a table
and writes JSON.

    python perf/bench_scheduler.py [--steps 200] [--device-ms 4] [--out perf/results/...json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path
from typing import Any

from m3serve.actors.scheduler import SchedulerActor
from m3serve.core.engine_core import EngineCore
from m3serve.core.executor import Executor
from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.core.step_inputs import StepInputs
from m3serve.core.trace import StepTrace
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams, StepPlan, StepResult
from m3serve.runtime.transport import InProcChannel

PAGE = 128
TINY_PAGE = 4  # the built-in tiny model's KV page
PROMPT = 1000


class NoOpExecutor:
    """Returns a token for every sampled row at once (optionally after a fake device time)."""

    def __init__(self, device_s: float = 0.0) -> None:
        self.device_s = device_s

    def run(self, plan: StepPlan) -> StepResult:
        if self.device_s:
            time.sleep(self.device_s)
        slots = [seq.slot for seq in plan.seqs if seq.sample]
        return StepResult(step=plan.step, slots=slots, tokens=[11] * len(slots))


def requests(running: int, prompt_len: int) -> list[Req]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4000)
    return [
        Req(f"r{i}", [(i * 7 + j) % 400 for j in range(prompt_len)], sampling, frozenset(), 0)
        for i in range(running)
    ]


def make_scheduler(running: int, prompt_len: int = PROMPT, page: int = PAGE) -> Scheduler:
    args = ServerArgs.from_kwargs(max_running_requests=running, max_prefill_tokens=1 << 20)
    pages = running * ((prompt_len + 4096) // page + 1)
    scheduler = Scheduler(args.sched, pages, page, radix=True)
    for req in requests(running, prompt_len):
        scheduler.add(req)
    return scheduler


class NoOpCore(EngineCore):
    """The engine core's step loop without a model: `run` returns a token for every sampled
    row after a fixed "device" time."""

    def __init__(self, scheduler: Scheduler, device_s: float) -> None:
        self.scheduler = scheduler
        self.runner = NoOpExecutor(device_s)
        self.executor = Executor(self.run)
        self._in_flight = None
        self.trace = StepTrace(log_every_step=False)
        self._ready_compiles = self.trace.compiles.count
        self.inputs = StepInputs(grammar=None, check=None)
        self.plans = None

    def run(self, plan: StepPlan) -> StepResult:
        return self.runner.run(plan)

    def close(self) -> None:
        self.executor.close()


class TimedCore(EngineCore):
    """The real engine core, keeping the seconds spent inside `run` per step."""

    seconds: list[float]

    def run(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        result = super().run(plan)
        self.seconds.append(time.perf_counter() - started)
        return result


def cpu_per_step(running: int, steps: int) -> dict[str, Any]:
    scheduler = make_scheduler(running)
    executor = NoOpExecutor()
    while any(not r.prefilled for r in scheduler.running) or scheduler.waiting:
        scheduler.process(executor.run(scheduler.schedule()))  # admit and prefill everyone
    plan_s = process_s = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        scheduler.process(executor.run(plan))
        process_s += time.perf_counter() - planned
        plan_s += planned - started
    per_step = (plan_s + process_s) / steps
    return {
        "running": running,
        "schedule_us": plan_s / steps * 1e6,
        "process_us": process_s / steps * 1e6,
        "cpu_us_per_step": per_step * 1e6,
        "cpu_us_per_request": per_step / running * 1e6,
    }


async def actor_step_time(core: EngineCore, steps: int, overlap: bool) -> float:
    """Wall seconds per decode step of the real SchedulerActor loop around `core`."""
    args = ServerArgs.from_kwargs(disable_overlap_schedule=not overlap)
    inbox, outputs = InProcChannel(), InProcChannel()
    actor = SchedulerActor(inbox.inbox(), [outputs.outbox()], None, args, Path("."))
    actor.core = core
    counted: list[float] = []

    async def drain() -> None:
        received = 0
        out_inbox = outputs.inbox()
        while True:
            await out_inbox.recv()
            received += 1
            counted.append(time.perf_counter())
            if received >= steps + 50:
                actor.stopping = True
                actor._wake.set()
                return

    drainer = asyncio.create_task(drain())
    await actor.loop()
    await drainer
    core.close()
    window = counted[50:]  # skip admission and prefill
    return (window[-1] - window[0]) / (len(window) - 1)


def _share(on: float, off: float, device: float) -> float:
    """Share of the exposed host work (off - device) that overlap removed, clamped to [0, 1]."""
    exposed = off - device
    return min(1.0, max(0.0, 1.0 - (on - device) / exposed)) if exposed > 0 else 0.0


def reference_backend_rows(steps: int) -> list[dict[str, Any]]:
    rows = []
    for running in (16, 64):
        times = {}
        for overlap in (True, False):
            # Short prompts, so the measured window is decode steps.
            # The pool and prefill budget of `make_scheduler`: every request admitted at once.
            args = ServerArgs.from_kwargs(
                max_running_requests=running,
                max_prefill_tokens=1 << 20,
                max_total_tokens=running * ((64 + 4096) // TINY_PAGE + 1) * TINY_PAGE,
            )
            core = TimedCore(args, None)
            core.seconds = []
            for req in requests(running, 64):
                core.add(req)
            step = asyncio.run(actor_step_time(core, steps, overlap))
            times[overlap] = (step, sum(core.seconds[-steps:]) / steps)
        (on, device_on), (off, device_off) = times[True], times[False]
        device = min(device_on, device_off)
        rows.append(
            {
                "running": running,
                "executor_ms": device * 1e3,
                "step_ms_overlap": on * 1e3,
                "step_ms_no_overlap": off * 1e3,
                "hidden_share": _share(on, off, device),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device-ms", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_scheduler.json"))
    args = parser.parse_args()
    rows = []
    for running in (64, 256):
        row = cpu_per_step(running, args.steps)
        device_s = args.device_ms / 1000
        on = asyncio.run(
            actor_step_time(NoOpCore(make_scheduler(running), device_s), args.steps, True)
        )
        off = asyncio.run(
            actor_step_time(NoOpCore(make_scheduler(running), device_s), args.steps, False)
        )
        row.update(
            device_ms=args.device_ms,
            step_ms_overlap=on * 1e3,
            step_ms_no_overlap=off * 1e3,
            hidden_share=_share(on, off, device_s),
        )
        rows.append(row)
    reference = reference_backend_rows(args.steps)
    print(f"scheduler, no-op executor, {platform.machine()} ({args.steps} steps)")
    print(
        f"{'running':>7} {'schedule µs':>12} {'process µs':>11} {'µs/req':>7} "
        f"{'device ms':>9} {'step ms (overlap)':>18} {'step ms (none)':>15} {'hidden':>7}"
    )
    for r in rows:
        print(
            f"{r['running']:7d} {r['schedule_us']:12.0f} {r['process_us']:11.0f} "
            f"{r['cpu_us_per_request']:7.1f} {r['device_ms']:9.1f} {r['step_ms_overlap']:18.2f} "
            f"{r['step_ms_no_overlap']:15.2f} {r['hidden_share']:7.0%}"
        )
    print("\nreal engine core, reference backend on CPU, built-in tiny model (decode steps)")
    print(
        f"{'running':>7} {'executor ms':>12} {'step ms (overlap)':>18} {'step ms (none)':>15} "
        f"{'hidden':>7}"
    )
    for r in reference:
        print(
            f"{r['running']:7d} {r['executor_ms']:12.2f} {r['step_ms_overlap']:18.2f} "
            f"{r['step_ms_no_overlap']:15.2f} {r['hidden_share']:7.0%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "bench_scheduler",
        "command": (
            f"python perf/bench_scheduler.py --steps {args.steps} --device-ms {args.device_ms}"
        ),
        "machine": platform.machine(),
        "rows": rows,
        "reference_backend_rows": reference,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
