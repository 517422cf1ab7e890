"""The API process's Prometheus metrics (`ServerMetrics`) and the `/metrics` text.

`ServerMetrics` owns what the request handlers record (requests by route and status, tokens,
latencies, finish reasons) plus two gauges derived at scrape time, in a prometheus_client
`CollectorRegistry` of its own: never the library's global one, so that several apps (tests,
embedded servers) can live in one process. `render` writes that registry and then the engine's
(`AsyncEngine.metrics`: running and waiting requests, KV usage, retractions) in the text format
0.0.4.

Names follow SGLang's (`sglang:` becomes `m3serve:`) or vLLM's where those exist, so existing
dashboards need only the prefix changed.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from m3serve.actors.engine_metrics import PREFIX

# The classic text format every Prometheus scrapes (prometheus_client's CONTENT_TYPE_LATEST is
# 1.0.0 since 0.23).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# TTFT spans sub-ms (cache hit, short prompt) to a minute (long prompt under load); ITL lives at
# the low end of the same range, so one bucket set serves both.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0,
)  # fmt: skip
# Powers of 4 from 1 to 4**10 (~1M) tokens: a handful of buckets across the whole context range.
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(4**i) for i in range(11))
THROUGHPUT_WINDOW_S = 10.0


class ServerMetrics:
    """The API's metric set, with the bookkeeping its derived gauges need."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = THROUGHPUT_WINDOW_S,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._window_s = window_s
        self._started = clock()
        self._recent: deque[tuple[float, int]] = deque()
        self._prompt_total = 0
        self._cached_total = 0
        self._lock = threading.Lock()
        self._register_counters()
        self._register_histograms()
        self._register_gauges()

    def _register_counters(self) -> None:
        # prometheus_client appends "_total" to a counter's name: m3serve:request_total etc.
        r = self.registry
        self.requests = Counter(
            PREFIX + "request",
            "HTTP requests by route and status code",
            ("endpoint", "status"),
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generation tokens produced", registry=r
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.successes = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            ("finish_reason",),
            registry=r,
        )
        self.aborts = Counter(
            PREFIX + "request_aborted", "Requests aborted before finishing", registry=r
        )

    def _register_histograms(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        # vLLM's names: "prompt_tokens" alone would share the family of prompt_tokens_total
        # once a scraper reads it as OpenMetrics.
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt tokens per finished request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generation tokens per finished request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )

    def _register_gauges(self) -> None:
        # Both are computed when the registry is collected, so any scrape sees current values.
        r = self.registry
        self.hit_rate = Gauge(
            PREFIX + "prefix_cache_hit_rate",
            "Cached over prompt tokens over the server's life",
            registry=r,
        )
        self.hit_rate.set_function(self._hit_rate)
        self.throughput = Gauge(
            PREFIX + "generation_throughput_tokens_per_s",
            f"Generated tokens per second over the last {self._window_s:g} s",
            registry=r,
        )
        self.throughput.set_function(lambda: self._throughput(self._clock()))

    # ------------------------------------------------------------ observations

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        itl_s: Sequence[float],
        e2e_s: float,
        finish_reason: str,
    ) -> None:
        """Records one finished request. `ttft_s` is None when no token was generated.

        Checked before anything is recorded, so a bad call leaves every series as it was."""
        if min(prompt_tokens, completion_tokens, cached_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        latencies = [e2e_s, *itl_s] if ttft_s is None else [ttft_s, e2e_s, *itl_s]
        if any(math.isnan(x) for x in latencies):
            # NaN fits no bucket and would poison _sum for the life of the server.
            raise ValueError("cannot observe a NaN latency")
        with self._lock:
            self._prompt_total += prompt_tokens
            self._cached_total += cached_tokens
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.successes.labels(finish_reason=finish_reason).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in itl_s:
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)

    def observe_aborted(self) -> None:
        self.aborts.inc()

    def count_tokens(self, n: int, now: float | None = None) -> None:
        """Counts `n` generated tokens toward the throughput gauge; called per streamed chunk."""
        now = self._clock() if now is None else now
        with self._lock:
            self._recent.append((now, n))
            self._prune(now)

    # ------------------------------------------------------------ rendering

    def render(self, engine: Collector | None = None) -> str:
        """The `/metrics` text: this registry's families, then those of `engine` (the engine's
        metrics, `AsyncEngine.metrics`) when given."""
        sources = [self.registry] if engine is None else [self.registry, engine]
        return generate_latest(_Scrape(sources)).decode()

    def _hit_rate(self) -> float:
        with self._lock:
            prompt, cached = self._prompt_total, self._cached_total
        return cached / prompt if prompt > 0 else 0.0

    def _throughput(self, now: float) -> float:
        with self._lock:
            self._prune(now)
            tokens = sum(n for _, n in self._recent)
        # In the first seconds of the server's life the window is not full yet: dividing by the
        # whole window would under-report.
        span = min(self._window_s, now - self._started)
        return tokens / span if span > 0 else 0.0

    def _prune(self, now: float) -> None:
        # Caller holds self._lock. Entries are appended in time order, so the oldest are left.
        cutoff = now - self._window_s
        while self._recent and self._recent[0][0] <= cutoff:
            self._recent.popleft()


class _Scrape(Collector):
    """Several collectors' families in order, without the `_created` samples prometheus_client
    adds to counters and histograms. Dashboards have never seen them, and the library's own
    switch (`disable_created_metrics`) would change every registry in the process, an embedding
    application's included."""

    def __init__(self, sources: Sequence[Collector]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                created = family.name + "_created"
                # A copy: a collector may hand out the same family object on every scrape.
                kept = copy.copy(family)
                kept.samples = [s for s in family.samples if s.name != created]
                yield kept
