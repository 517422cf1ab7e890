"""`EngineMetrics`: the engine process's Prometheus metrics, its load figures (running and
waiting requests, KV pool and prefix-cache use, retractions, prompt tokens found cached on the
device or loaded back from the HiCache host pool, tokens fetched from its L3 storage, host pool
use), which `SchedulerActor` writes
from its scheduler after every step.

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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.scheduler import Scheduler

PREFIX = "m3serve:"
# Acceptance lengths are whole numbers 1..block+1 (8 for DSpark): one bucket each.
ACCEPT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, float("inf"))


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
        self.cached_prompt_tokens = Counter(
            PREFIX + "cached_prompt_tokens",
            "Prompt tokens found in the device prefix cache at admission",
            registry=r,
        )
        self.host_hit_tokens = Counter(
            PREFIX + "hicache_host_hit_tokens",
            "Prompt tokens loaded back from the HiCache host pool instead of computed",
            registry=r,
        )
        self.storage_hit_tokens = Counter(
            PREFIX + "hicache_storage_hit_tokens",
            "Prompt tokens fetched from the HiCache L3 storage into the host pool",
            registry=r,
        )
        self.host_cached_pages = Gauge(
            PREFIX + "hicache_host_cached_pages",
            "KV pages held in the HiCache host pool",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.host_usage = Gauge(
            PREFIX + "hicache_host_usage_ratio",
            "Fraction of the HiCache host pool in use",
            registry=r,
            multiprocess_mode="livemax",
        )
        # Speculative decoding: tokens each verify row committed (accepted drafts + 1).
        self.spec_accept_length = Histogram(
            PREFIX + "spec_accept_length",
            "Tokens committed per speculative verify step of a request (accepted drafts + 1)",
            buckets=ACCEPT_BUCKETS,
            registry=r,
        )
        self._last: tuple[int, ...] | None = None
        self._totals: dict[Counter, int] = {}
        self._accepts: dict[int, int] = {}

    def update(self, scheduler: Scheduler, compiles_after_ready: int = 0) -> None:
        """Writes the scheduler's current figures. Steps that change none of them (most decode
        steps of a steady batch) write nothing."""
        self._observe_accepts(scheduler.spec_accept_counts)
        pool = scheduler.pool
        host = scheduler.cache.host_pool if isinstance(scheduler.cache, HiPrefixCache) else None
        host_used = host.num_pages - host.num_free if host is not None else 0
        figures = (
            len(scheduler.running),
            len(scheduler.waiting),
            pool.num_pages - pool.num_free,
            scheduler.cache.tree.cached_pages,
            host_used,
            scheduler.retracted,
            compiles_after_ready,
            scheduler.cached_prompt_tokens,
            scheduler.host_hit_tokens,
            scheduler.storage.hit_tokens if scheduler.storage is not None else 0,
        )
        if figures == self._last:
            return
        self._last = figures
        running, waiting, used_pages, cached_pages, host_used = figures[:5]
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(used_pages / pool.num_pages if pool.num_pages > 0 else 0.0)
        self.cached_pages.set(cached_pages)
        if host is not None:
            self.host_cached_pages.set(host_used)
            self.host_usage.set(host_used / host.num_pages if host.num_pages > 0 else 0.0)
        self._advance(self.retractions, scheduler.retracted)
        self._advance(self.compiles, compiles_after_ready)
        self._advance(self.cached_prompt_tokens, scheduler.cached_prompt_tokens)
        self._advance(self.host_hit_tokens, scheduler.host_hit_tokens)
        self._advance(self.storage_hit_tokens, figures[-1])

    def _observe_accepts(self, counts: dict[int, int]) -> None:
        """The scheduler counts verify rows by committed length; observe the new ones."""
        for length, total in counts.items():
            for _ in range(total - self._accepts.get(length, 0)):
                self.spec_accept_length.observe(length)
            self._accepts[length] = total

    def _advance(self, counter: Counter, total: int) -> None:
        """The scheduler keeps running totals; a Counter only moves forward by increments."""
        last = self._totals.get(counter, 0)
        if total > last:
            counter.inc(total - last)
            self._totals[counter] = total
