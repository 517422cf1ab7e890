"""Prometheus metrics: a minimal text-exposition (format 0.0.4) implementation and the server's set.

`Counter`, `Gauge` and `Histogram` hold one series per combination of label values; a `Registry`
renders them in registration order. Each metric guards its series with its own lock, so the API's
event loop and an occasional other thread (the engine-stats reader) can update them safely.

`ServerMetrics` is the set `/metrics` serves, named after SGLang's (`sglang:` becomes `m3serve:`)
or vLLM's where those exist, so existing dashboards need only the prefix changed.
"""

from __future__ import annotations

import math
import re
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Integral floats below this are exact, so printing them as ints loses nothing.
_EXACT_INT_LIMIT = 2.0**53

LabelKey = tuple[str, ...]


# ---------------------------------------------------------------- text formatting


def format_value(value: float) -> str:
    """A sample value or `le` bound: integers without ".0" or exponent, infinities as +Inf/-Inf."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < _EXACT_INT_LIMIT:
        return str(int(value))
    # repr is the shortest text that parses back to the same float.
    return repr(value)


def escape_label_value(value: str) -> str:
    """Escapes backslash, double quote and newline, as the exposition format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text escapes only backslash and newline (a quote is literal there)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = (f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + ",".join(pairs) + "}"


# ---------------------------------------------------------------- metrics


class Metric:
    """A metric family: name, help, declared label names, and a lock over its series."""

    kind: ClassVar[str]
    reserved_labels: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        _check_names(name, labels, self.reserved_labels)
        self.name = name
        self.help = help
        self.labelnames = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: Mapping[str, object]) -> LabelKey:
        if labels.keys() != set(self.labelnames):
            raise ValueError(
                f"{self.name}: labels {sorted(labels)} given, {list(self.labelnames)} declared"
            )
        return tuple(str(labels[n]) for n in self.labelnames)

    def render(self) -> str:
        """The HELP and TYPE lines followed by every sample line, each ending in a newline."""
        head = [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        return "".join(line + "\n" for line in [*head, *self._samples()])

    def _samples(self) -> Iterator[str]:
        raise NotImplementedError


def _check_names(name: str, labels: Iterable[str], reserved: frozenset[str]) -> None:
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"invalid metric name {name!r}")
    seen: set[str] = set()
    for label in labels:
        # Names starting with "__" are reserved for Prometheus' internal use.
        if not _LABEL_NAME.fullmatch(label) or label.startswith("__") or label in reserved:
            raise ValueError(f"{name}: invalid label name {label!r}")
        if label in seen:
            raise ValueError(f"{name}: duplicate label name {label!r}")
        seen.add(label)


class _ScalarMetric(Metric):
    """One float per series: the shared body of Counter and Gauge."""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        # A label-less metric shows 0 before its first update rather than being absent.
        self._values: dict[LabelKey, float] = {} if labels else {(): 0.0}

    def _add(self, amount: float, labels: Mapping[str, object]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The current value of one series (0 if it was never updated)."""
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def _samples(self) -> Iterator[str]:
        with self._lock:
            items = list(self._values.items())
        for key, value in items:
            yield f"{self.name}{_label_text(self.labelnames, key)} {format_value(value)}"


class Counter(_ScalarMetric):
    """A monotonically increasing count."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if not amount >= 0:  # also catches NaN
            raise ValueError(f"{self.name}: counter increment must be >= 0, got {amount}")
        self._add(amount, labels)


class Gauge(_ScalarMetric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._add(-amount, labels)


@dataclass(slots=True)
class _HistogramSeries:
    counts: list[int]  # per bucket, not cumulative: cumulated at render time
    total: float = 0.0
    count: int = 0


@dataclass(frozen=True)
class HistogramSnapshot:
    """One series' state: cumulative bucket counts (aligned with `Histogram.bounds`), sum, count."""

    cumulative: tuple[int, ...]
    total: float
    count: int


class Histogram(Metric):
    """Observations counted into buckets with upper bounds; +Inf is always the last bucket."""

    kind = "histogram"
    reserved_labels = frozenset({"le"})

    def __init__(
        self, name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> None:
        super().__init__(name, help, labels)
        self.bounds = _check_buckets(name, buckets)
        self._series: dict[LabelKey, _HistogramSeries] = {} if labels else {(): self._new()}

    def _new(self) -> _HistogramSeries:
        return _HistogramSeries(counts=[0] * len(self.bounds))

    def observe(self, value: float, **labels: str) -> None:
        if math.isnan(value):
            # NaN fits no bucket and would poison _sum for the life of the server.
            raise ValueError(f"{self.name}: cannot observe NaN")
        key = self._key(labels)
        index = bisect_left(self.bounds, value)  # first bound >= value: buckets are "le"
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = self._new()
            series.counts[index] += 1
            series.total += value
            series.count += 1

    def snapshot(self, **labels: str) -> HistogramSnapshot:
        """The state of one series (all zero if it was never observed)."""
        key = self._key(labels)
        with self._lock:
            series = self._series.get(key) or self._new()
            return _snapshot(series)

    def _samples(self) -> Iterator[str]:
        with self._lock:
            items = [(key, _snapshot(series)) for key, series in self._series.items()]
        for key, snap in items:
            yield from self._series_lines(key, snap)

    def _series_lines(self, key: LabelKey, snap: HistogramSnapshot) -> Iterator[str]:
        names = (*self.labelnames, "le")
        for bound, cumulative in zip(self.bounds, snap.cumulative, strict=True):
            labels = _label_text(names, (*key, format_value(bound)))
            yield f"{self.name}_bucket{labels} {cumulative}"
        labels = _label_text(self.labelnames, key)
        yield f"{self.name}_sum{labels} {format_value(snap.total)}"
        yield f"{self.name}_count{labels} {snap.count}"


def _snapshot(series: _HistogramSeries) -> HistogramSnapshot:
    cumulative: list[int] = []
    running = 0
    for count in series.counts:
        running += count
        cumulative.append(running)
    return HistogramSnapshot(tuple(cumulative), series.total, series.count)


def _check_buckets(name: str, buckets: Sequence[float]) -> tuple[float, ...]:
    bounds = [float(b) for b in buckets]
    if any(math.isnan(b) for b in bounds):
        raise ValueError(f"{name}: NaN bucket bound")
    if any(a >= b for a, b in pairwise(bounds)):
        raise ValueError(f"{name}: bucket bounds must be strictly increasing, got {buckets}")
    if not bounds or bounds[-1] != math.inf:
        bounds.append(math.inf)
    return tuple(bounds)


# ---------------------------------------------------------------- registry


# Keeps `Registry.counter()` typed as Counter rather than Metric.
_M = TypeVar("_M", bound=Metric)


class Registry:
    """Metrics by name, rendered in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._register(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._register(Gauge(name, help, labels))

    def histogram(
        self, name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> Histogram:
        return self._register(Histogram(name, help, buckets, labels))

    def _register(self, metric: _M) -> _M:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name!r} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        """The whole exposition text (format 0.0.4)."""
        with self._lock:
            metrics = list(self._metrics.values())
        return "".join(metric.render() for metric in metrics)


# ---------------------------------------------------------------- the server's metrics

PREFIX = "m3serve:"

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
    """The metric set `/metrics` serves, with the bookkeeping its derived gauges need."""

    def __init__(
        self,
        registry: Registry | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = THROUGHPUT_WINDOW_S,
    ) -> None:
        self.registry = registry if registry is not None else Registry()
        self._clock = clock
        self._window_s = window_s
        self._started = clock()
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._register_counters()
        self._register_histograms()
        self._register_gauges()

    def _register_counters(self) -> None:
        r = self.registry
        self.requests = r.counter(
            PREFIX + "request_total",
            "HTTP requests by route and status code",
            ("endpoint", "status"),
        )
        self.prompt_tokens = r.counter(PREFIX + "prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = r.counter(
            PREFIX + "generation_tokens_total", "Generation tokens produced"
        )
        self.cached_tokens = r.counter(
            PREFIX + "cached_tokens_total", "Prompt tokens served from the prefix cache"
        )
        self.successes = r.counter(
            PREFIX + "request_success_total",
            "Finished requests by finish reason",
            ("finish_reason",),
        )
        self.aborts = r.counter(
            PREFIX + "request_aborted_total", "Requests aborted before finishing"
        )

    def _register_histograms(self) -> None:
        r = self.registry
        self.ttft = r.histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS
        )
        self.itl = r.histogram(
            PREFIX + "inter_token_latency_seconds", "Time between output tokens", LATENCY_BUCKETS
        )
        self.e2e = r.histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS
        )
        # vLLM's names: "prompt_tokens" alone would share the family of prompt_tokens_total
        # once a scraper reads it as OpenMetrics.
        self.request_prompt_tokens = r.histogram(
            PREFIX + "request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS
        )
        self.request_generation_tokens = r.histogram(
            PREFIX + "request_generation_tokens",
            "Generation tokens per finished request",
            TOKEN_BUCKETS,
        )

    def _register_gauges(self) -> None:
        r = self.registry
        self.running = r.gauge(PREFIX + "num_running_reqs", "Requests in the running batch")
        self.waiting = r.gauge(PREFIX + "num_waiting_reqs", "Requests waiting to be scheduled")
        self.kv_usage = r.gauge(PREFIX + "kv_cache_usage_ratio", "Fraction of the KV pool in use")
        self.hit_rate = r.gauge(
            PREFIX + "prefix_cache_hit_rate", "Cached over prompt tokens over the server's life"
        )
        self.throughput = r.gauge(
            PREFIX + "generation_throughput_tokens_per_s",
            f"Generated tokens per second over the last {format_value(self._window_s)} s",
        )
        self.retractions = r.gauge(
            PREFIX + "num_retractions_total", "Requests the engine retracted (engine's counter)"
        )

    # ------------------------------------------------------------ observations

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.inc(endpoint=endpoint, status=str(status))

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
        """Records one finished request. `ttft_s` is None when no token was generated."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.successes.inc(finish_reason=finish_reason)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in itl_s:
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)

    def observe_aborted(self) -> None:
        self.aborts.inc()

    def set_engine_stats(
        self, running: int, waiting: int, kv_used: int, kv_total: int, retractions: int
    ) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_used / kv_total if kv_total > 0 else 0.0)
        self.retractions.set(retractions)

    def count_tokens(self, n: int, now: float | None = None) -> None:
        """Counts `n` generated tokens toward the throughput gauge; called per streamed chunk."""
        now = self._clock() if now is None else now
        with self._lock:
            self._recent.append((now, n))
            self._prune(now)

    # ------------------------------------------------------------ rendering

    def render(self) -> str:
        self.hit_rate.set(self._hit_rate())
        self.throughput.set(self._throughput(self._clock()))
        return self.registry.render()

    def _hit_rate(self) -> float:
        prompt = self.prompt_tokens.value()
        return self.cached_tokens.value() / prompt if prompt > 0 else 0.0

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
