"""`EngineMetrics`: the engine process's Prometheus metrics, its load figures (running and
waiting requests, KV pool and prefix-cache use, retractions), which `SchedulerActor` writes from
its scheduler after every step.

They live in a `CollectorRegistry` of their own. When the actors run as processes, the engine
process has put prometheus_client in multiprocess mode before importing it (`engine_process` in
engine/launch.py), so each write lands in an mmap file that the API process reads with a
`MultiProcessCollector`; in single-process mode the API renders `registry` itself. This module
does the same in both.

How the gauges combine over several engine processes (`multiprocess_mode`): request and page
counts belong to one scheduler each, so they add up over the live processes (`livesum`), which
is right for one engine process and for data-parallel ranks with their own requests and pools;
the usage ratio reports the fullest pool (`livemax`). Tensor-parallel ranks that replicate one
scheduler must update these from rank 0 only. A process marked dead (the API process does that
when the engine process exits) loses its live gauges; the retraction counter keeps what every
process counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from m3serve.core.scheduler import Scheduler

PREFIX = "m3serve:"


class EngineMetrics:
    """The engine's load gauges and retraction counter, updated with `update(scheduler)`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(
            PREFIX + "num_running_reqs",
            "Requests in the running batch",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waiting = Gauge(
            PREFIX + "num_waiting_reqs",
            "Requests waiting to be scheduled",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_usage = Gauge(
            PREFIX + "kv_cache_usage_ratio",
            "Fraction of the KV pool in use",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cached_pages = Gauge(
            PREFIX + "num_cached_pages",
            "KV pages held by the prefix cache",
            registry=r,
            multiprocess_mode="livesum",
        )
        # prometheus_client appends "_total": the series is m3serve:num_retractions_total.
        self.retractions = Counter(
            PREFIX + "num_retractions",
            "Requests the engine retracted (queued again to free KV pages)",
            registry=r,
        )
        # Non-zero means a request waited for a Triton compile (see core/warmup.py).
        self.compiles = Counter(
            PREFIX + "kernel_compiles_after_ready",
            "Triton kernels compiled (or loaded from the disk cache) after the engine was ready",
            registry=r,
        )
        self._last: tuple[int, int, int, int, int, int] | None = None
        self._retracted = 0
        self._compiled = 0

    def update(self, scheduler: Scheduler, compiles_after_ready: int = 0) -> None:
        """Writes the scheduler's current figures. Steps that change none of them (most decode
        steps of a steady batch) write nothing."""
        pool = scheduler.pool
        figures = (
            len(scheduler.running),
            len(scheduler.waiting),
            pool.num_pages - pool.num_free,
            scheduler.cache.tree.cached_pages,
            scheduler.retracted,
            compiles_after_ready,
        )
        if figures == self._last:
            return
        self._last = figures
        running, waiting, used_pages, cached_pages, retracted, compiled = figures
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(used_pages / pool.num_pages if pool.num_pages > 0 else 0.0)
        self.cached_pages.set(cached_pages)
        # The scheduler keeps a running total; a Counter only moves forward by increments.
        if retracted > self._retracted:
            self.retractions.inc(retracted - self._retracted)
            self._retracted = retracted
        if compiled > self._compiled:
            self.compiles.inc(compiled - self._compiled)
            self._compiled = compiled
