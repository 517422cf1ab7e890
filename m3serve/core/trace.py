"""What each engine step did and cost, so that a stalled step can be found in the log.

`StepTrace` (with `--enable-step-trace`) logs one line per step: its kind (prefill, decode, mixed),
batch, new tokens, the host time around it (planning and processing, on the event loop), the run
time (forward and sampling, on the executor thread) and the Triton kernels compiled while it ran;
and where a step's time outside its run went: `idle=`, how long the executor thread had waited
for this plan since its previous run ended (the event loop was late to launch it), and `lag=`,
how long the finished result waited for the event loop to process it (its tokens reach the
clients only then). A step that samples also logs `launch=`, the part of its run until its
kernels were all queued: near the whole run, the host's launching set the step's pace, not the
device; and `build=`, the part of that launch spent building the step's batch, where it was not
built ahead while the step before ran; `cpu=`, the executor thread's CPU time in that launch (far
below `launch=`: the thread could not run, waiting for the GIL or for a CPU), and `preempted=`,
how often the OS took the CPU from it during the run while it could have gone on (a CPU-starved
engine, not a GIL-bound one); on a GPU, `device=`, its kernels' device time from the first to the
draw (core/device_clock.py: a step launched ahead may have run in part before its run began).
`CompileCounter` sees those compilations through Triton's post-compile hook; a step that compiled
anything is logged as a warning whether or not the trace is on, since that stall is what a
server must never do after it reported ready. With the trace on, `GcPauses` adds the garbage
collector's time between a step's planning and its processing (`gc=`), the other stall a
Python server has, and each collection of a millisecond or more gets a line of its own
(`gc pause ...`: its generation, the objects it freed and the thread that waited it out).
On a GPU the trace also watches the CUDA caching allocator (`AllocWatch`): an allocation it
had to retry after freeing its cache waited for the device, and one that took new memory from
the device (cudaMalloc) held the host for as long, stalls no other field shows.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from m3serve.runtime.messages import StepPlan

try:
    import resource

    _PER_THREAD: int | None = resource.RUSAGE_THREAD  # Linux
except (ImportError, AttributeError):
    _PER_THREAD = None

log = logging.getLogger(__name__)

StepKind = Literal["prefill", "decode", "mixed"]


def thread_usage() -> tuple[float, int]:
    """The calling thread's CPU seconds so far and how often the OS took the CPU away from it
    while it could run (involuntary context switches; 0 where they are not counted per
    thread)."""
    cpu = time.thread_time()
    if _PER_THREAD is None:
        return cpu, 0
    return cpu, resource.getrusage(_PER_THREAD).ru_nivcsw


def step_kind(plan: StepPlan) -> StepKind:
    """Decode seqs read their one input token from the slot table; every other seq prefills."""
    decodes = sum(seq.input_ids is None for seq in plan.seqs)
    if decodes == len(plan.seqs):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


class CompileCounter:
    """Names of the Triton kernels compiled (or loaded from the disk cache) in this process,
    in order. Installs Triton's post-compile hook, keeping any hook that was there before."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._lock = threading.Lock()
        self._previous: Any = None
        self._knobs: Any = None
        try:
            from triton import knobs
        except ImportError:  # no triton: nothing can compile
            return
        self._knobs = knobs
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook

    @property
    def hooked(self) -> bool:
        """Whether it sees compiles (Triton is there)."""
        return self._knobs is not None

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.names)

    def since(self, count: int) -> list[str]:
        with self._lock:
            return self.names[count:]

    def close(self) -> None:
        if self._knobs is not None and self._knobs.runtime.jit_post_compile_hook == self._hook:
            self._knobs.runtime.jit_post_compile_hook = self._previous

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        with self._lock:
            self.names.append(getattr(fn, "name", "?"))
        return self._previous(*args, **kwargs) if self._previous else None


# A collection at least this long is logged on its own (generation, thread, objects freed):
# served young collections of 3.5-6.8 ms were seen on the H200 (12-05), none of them full.
LONG_PAUSE_MS = 1.0


@dataclass(frozen=True)
class GcPause:
    ms: float
    generation: int
    collected: int  # objects freed
    thread: str  # the thread that triggered it (and waited it out)


class GcPauses:
    """The garbage collector's running total of pause time in this process, in ms (its
    start/stop callbacks; a collection runs in whichever thread triggered it, holding the GIL),
    and the part of it in full (oldest-generation) collections: those walk every object not
    frozen at start-up, the young ones only what was made since the last. Collections of
    LONG_PAUSE_MS or more are kept one by one (`take_long`) for the trace to log."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self.full_ms = 0.0
        self._started = 0.0
        self._long: list[GcPause] = []
        gc.callbacks.append(self._callback)

    def take_long(self) -> list[GcPause]:
        """The long collections since the last call (the list is swapped, not copied: a
        callback on another thread appends to the new one)."""
        taken, self._long = self._long, []
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self._started)
        self.total_ms += ms
        generation = info.get("generation", -1)
        if generation == 2:
            self.full_ms += ms
        if ms >= LONG_PAUSE_MS:
            thread = threading.current_thread().name
            self._long.append(GcPause(ms, generation, info.get("collected", 0), thread))


# The CUDA allocator's counters are read every this many runs: `torch.cuda.memory_stats` builds
# a dict of some 200 of them.
ALLOC_CHECK_EVERY = 64


class AllocWatch:
    """Allocations the CUDA caching allocator had to retry, and those it took from the device.
    One that finds neither a cached block nor free device memory frees every cached block
    (cudaFree, which first waits for all the work queued on the device) and allocates again;
    one that finds no cached block takes new device memory (cudaMalloc, which the host waits
    for): milliseconds in whichever step asked, seen only as a slow launch. `read` gives the
    allocator's running counts of both; a rise is logged with the steps it happened in,
    checked every ALLOC_CHECK_EVERY runs."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read
        self._seen = read()
        self._runs = 0
        self._first_step: int | None = None  # the first run since the last check

    def check(self, step: int) -> None:
        """Called by the executor thread as each run ends."""
        if self._first_step is None:
            self._first_step = step
        self._runs += 1
        if self._runs % ALLOC_CHECK_EVERY:
            return
        counts = self._read()
        retried, taken = (now - before for now, before in zip(counts, self._seen, strict=True))
        if retried > 0:
            log.info("CUDA allocator: %d allocations retried after freeing its cache (each "
                     "waits for the device) in steps %d-%d", retried, self._first_step,
                     step)  # fmt: skip
        if taken > 0:
            log.info("CUDA allocator: %d allocations took new device memory (cudaMalloc: the "
                     "host waits) in steps %d-%d", taken, self._first_step, step)  # fmt: skip
        self._seen = counts
        self._first_step = None


@dataclass
class StepRecord:
    plan: StepPlan
    schedule_ms: float
    run_ms: float = 0.0
    process_ms: float = 0.0
    compiled: list[str] = field(default_factory=list)
    # Collector pauses from planning to processing (the trace's GcPauses): the running total's
    # negative when planned, the total added back when processed.
    gc_ms: float = 0.0
    gc_full_ms: float = 0.0  # the part of gc_ms in full collections, kept the same way
    # The mixed-step prompt budget the plan was held to (0: none): the served budget moves with
    # the steps run, and a log line of it goes out at most every 30 s.
    budget: int = 0
    # The decode batch that budget was sized for (core/scheduler.py `_batch_ahead`; 0: none),
    # logged where more than the step decodes: requests were waiting for a slot.
    budget_rows: int = 0
    idle_ms: float = 0.0  # the executor's wait for this plan after its previous run
    lag_ms: float = 0.0  # the finished result's wait for the event loop
    # From the run's start until its kernels were all queued (0: it samples nothing): where it
    # is most of `run_ms` the host, not the device, sets the step's pace.
    launch_ms: float = 0.0
    # The part of the launch that built the step's batch (0: `prepare` built it ahead while the
    # step before ran, as it should on a GPU): a step whose plan came too late to build ahead.
    build_ms: float = 0.0
    # The executor thread's CPU time in the launch, and the times the OS preempted it in the run.
    launch_cpu_ms: float = 0.0
    preempted: int = 0
    # Its kernels' device time, from the first to the draw (core/device_clock.py; 0: not known,
    # a CPU): with steps launched ahead, part of a step may run before its run began.
    device_ms: float = 0.0
    # While its kernels ran (a GPU's executor, core/executor.py): from the hand-over of the
    # step before's result (the event loop plans the step after next from it) to that plan's
    # arrival, and the time building or launching it. Where the two outlast `device_ms`, the
    # round trip through the event loop, not the device, set the step's pace.
    wait_ms: float = 0.0
    ahead_ms: float = 0.0
    finished_at: float = 0.0  # perf_counter() when the run ended

    @property
    def tokens(self) -> int:
        return sum(seq.extend for seq in self.plan.seqs)

    def line(self) -> str:
        host = self.schedule_ms + self.process_ms
        compiled = ""
        if self.compiled:
            compiled = f" compiled {len(self.compiled)}: {', '.join(self.compiled)}"
        loaded = sum(len(copy.device) for copy in self.plan.loads)
        loads = f" load-back={loaded} pages" if loaded else ""
        full = f"(full {self.gc_full_ms:.2f})" if self.gc_full_ms >= 0.005 else ""
        paused = f" gc={self.gc_ms:.2f}ms{full}" if self.gc_ms >= 0.005 else ""
        kind = step_kind(self.plan)
        budget = f" budget={self.budget}" if self.budget and kind == "mixed" else ""
        if budget and self.budget_rows > sum(seq.input_ids is None for seq in self.plan.seqs):
            budget += f"({self.budget_rows} rows)"
        launch = f" launch={self.launch_ms:.2f}ms" if self.launch_ms else ""
        build = f" build={self.build_ms:.2f}ms" if self.build_ms >= 0.005 else ""
        cpu = f" cpu={self.launch_cpu_ms:.2f}ms" if self.launch_ms else ""
        preempted = f" preempted={self.preempted}" if self.preempted else ""
        device = f" device={self.device_ms:.2f}ms" if self.device_ms else ""
        if self.ahead_ms:
            device += f" wait={self.wait_ms:.2f}ms ahead={self.ahead_ms:.2f}ms"
        return (
            f"step {self.plan.step} {kind} batch={len(self.plan.seqs)} "
            f"tokens={self.tokens}{loads} host={host:.2f}ms (plan {self.schedule_ms:.2f} + "
            f"process {self.process_ms:.2f}) run={self.run_ms:.2f}ms idle={self.idle_ms:.2f}ms "
            f"lag={self.lag_ms:.2f}ms{launch}{paused}{budget}{build}{cpu}{preempted}{device}"
            f"{compiled}"
        )


class StepTrace:
    """Collects a `StepRecord` per step from the three places that see it: planning (event
    loop), running (executor thread, strictly before its result is processed) and processing."""

    def __init__(self, log_every_step: bool) -> None:
        self.log_every_step = log_every_step
        self.compiles = CompileCounter()
        self.gc = GcPauses() if log_every_step else None
        self._records: dict[int, StepRecord] = {}
        self._unlogged: list[StepRecord] = []  # processed, logged by `log_processed`
        self._last_run_end: float | None = None  # executor thread only
        self._serving = False  # a step has been planned: start-up is over
        self.alloc: AllocWatch | None = None

    def watch_allocator(self, read: Callable[[], tuple[int, int]]) -> None:
        """With the trace on, log the CUDA allocator's retried allocations and those that took
        new device memory from here on (`read`: its running counts of both)."""
        if self.log_every_step:
            self.alloc = AllocWatch(read)

    def planned(
        self, plan: StepPlan, seconds: float, budget: int = 0, budget_rows: int = 0
    ) -> None:
        """`budget`: the mixed-step prompt budget the plan was held to (0: none), sized for a
        decode batch of `budget_rows`."""
        paused, full = 0.0, 0.0
        if self.gc is not None:  # the running totals now; processing adds them back
            paused, full = -self.gc.total_ms, -self.gc.full_ms
            if not self._serving:
                # Start-up's collections stalled no step: the warm-up's, and the full one that
                # freezes the heap before ready (~70 ms on the CPU model, 250K objects).
                self.gc.take_long()
        self._serving = True
        self._records[plan.step] = StepRecord(
            plan,
            seconds * 1e3,
            gc_ms=paused,
            gc_full_ms=full,
            budget=budget,
            budget_rows=budget_rows,
        )

    def ran(
        self,
        step: int,
        seconds: float,
        compiles_before: int,
        launch_seconds: float = 0.0,
        build_seconds: float = 0.0,
        launch_cpu_seconds: float = 0.0,
        preempted: int = 0,
        device_seconds: float = 0.0,
        ahead: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Called by the executor thread as a run of `seconds` ends, `launch_seconds` of it
        until its kernels were queued (0: not known), `build_seconds` of that building its
        batch (0: built ahead), `launch_cpu_seconds` the thread's CPU time in the launch;
        `preempted`: the OS's involuntary switches away from the thread during the run;
        `device_seconds`: its kernels' device time (0: not known); `ahead`: while its kernels
        ran, the wait for the next step's plan and the seconds building or launching that step
        (core/executor.py; (0, 0): none was)."""
        now = time.perf_counter()
        idle = now - seconds - self._last_run_end if self._last_run_end is not None else 0.0
        self._last_run_end = now
        record = self._records.get(step)
        if record is not None:
            record.run_ms = seconds * 1e3
            record.launch_ms = launch_seconds * 1e3
            record.build_ms = build_seconds * 1e3
            record.launch_cpu_ms = launch_cpu_seconds * 1e3
            record.preempted = preempted
            record.device_ms = device_seconds * 1e3
            record.wait_ms, record.ahead_ms = ahead[0] * 1e3, ahead[1] * 1e3
            record.idle_ms = max(idle, 0.0) * 1e3
            record.finished_at = now
            record.compiled = self.compiles.since(compiles_before)
        if self.alloc is not None:
            self.alloc.check(step)

    def processed(self, step: int, seconds: float) -> StepRecord | None:
        """Called as processing of `seconds` (begun once the result was in) ends."""
        record = self._records.pop(step, None)
        if record is None:
            return None
        record.process_ms = seconds * 1e3
        if record.finished_at:
            began = time.perf_counter() - seconds
            record.lag_ms = max(began - record.finished_at, 0.0) * 1e3
        if self.gc is not None:
            record.gc_ms += self.gc.total_ms
            record.gc_full_ms += self.gc.full_ms
        if record.compiled or self.log_every_step:
            self._unlogged.append(record)
        return record

    def log_processed(self) -> None:
        """Log the steps processed since the last call (and long gc pauses). Apart from
        `processed` so that the overlap scheduler can launch the next step first: a write
        lets go of the GIL, and the executor may be waiting for that step's plan."""
        for record in self._unlogged:
            if record.compiled:
                log.warning("%s (a compile stalls every request in the step)", record.line())
            else:
                log.info("%s", record.line())
        self._unlogged.clear()
        if self.gc is not None:
            for pause in self.gc.take_long():
                log.info("gc pause %.2f ms: generation %d, %d objects freed, in thread %s",
                         pause.ms, pause.generation, pause.collected, pause.thread)  # fmt: skip

    def close(self) -> None:
        self.compiles.close()
        if self.gc is not None:
            self.gc.close()


class StartupPhases:
    """Wall time of each start-up phase (load weights, KV pool, warm-up, CUDA graphs), logged as
    each ends and summed up in one line when the engine is ready."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started
        log.info("start-up: %s took %.2f s%s", name, self.seconds[name], self._note(name))

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def line(self) -> str:
        parts = [f"{name} {s:.2f} s{self._note(name)}" for name, s in self.seconds.items()]
        return f"start-up {sum(self.seconds.values()):.2f} s: " + ", ".join(parts)

    def _note(self, name: str) -> str:
        return f" ({self.notes[name]})" if name in self.notes else ""
