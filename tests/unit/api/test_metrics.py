"""Prometheus exposition: golden text, histogram invariants, validation, and the server's set."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.api.metrics import (
    CONTENT_TYPE,
    Counter,
    Gauge,
    Histogram,
    Registry,
    ServerMetrics,
    format_value,
)

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
# A label value: any characters but an unescaped quote, backslash or newline.
LABEL_PAIR = rf'({LABEL_NAME})="((?:[^"\\\n]|\\[\\"n])*)"'
SAMPLE = re.compile(rf"({METRIC_NAME})(?:\{{((?:{LABEL_PAIR},?)*)\}})? (\S+)")
Labels = tuple[tuple[str, str], ...]


def parse(text: str) -> dict[tuple[str, Labels], float]:
    """A strict little parser for the subset we emit: every line is a comment or a sample."""
    assert text.endswith("\n")
    samples: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if line.startswith("# "):
            assert re.fullmatch(rf"# (HELP {METRIC_NAME} .*|TYPE {METRIC_NAME} \w+)", line), line
            continue
        match = SAMPLE.fullmatch(line)
        assert match, f"not a sample line: {line!r}"
        name, body, value = match.group(1), match.group(2) or "", match.group(5)
        labels = tuple((n, _unescape(v)) for n, v in re.findall(LABEL_PAIR, body))
        key = (name, labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)  # float() accepts "+Inf" and "NaN"
    return samples


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


# ---------------------------------------------------------------- exposition format


def test_golden_exposition() -> None:
    registry = Registry()
    requests = registry.counter("http_requests_total", "Requests.\nBy path", ("path",))
    temp = registry.gauge("temperature", 'Degrees "C" \\ heat')
    latency = registry.histogram("latency_seconds", "Latency", (0.5, 1, 2.5), ("route",))
    requests.inc(path='/a"b\\c\nd')
    requests.inc(2, path="/x")
    temp.set(-3.25)
    for value in (0.1, 0.5, 2, 7):
        latency.observe(value, route="r")
    assert registry.render() == (
        "# HELP http_requests_total Requests.\\nBy path\n"
        "# TYPE http_requests_total counter\n"
        'http_requests_total{path="/a\\"b\\\\c\\nd"} 1\n'
        'http_requests_total{path="/x"} 2\n'
        '# HELP temperature Degrees "C" \\\\ heat\n'
        "# TYPE temperature gauge\n"
        "temperature -3.25\n"
        "# HELP latency_seconds Latency\n"
        "# TYPE latency_seconds histogram\n"
        'latency_seconds_bucket{route="r",le="0.5"} 2\n'
        'latency_seconds_bucket{route="r",le="1"} 2\n'
        'latency_seconds_bucket{route="r",le="2.5"} 3\n'
        'latency_seconds_bucket{route="r",le="+Inf"} 4\n'
        'latency_seconds_sum{route="r"} 9.6\n'
        'latency_seconds_count{route="r"} 4\n'
    )
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_escaped_label_value_round_trips_through_parser() -> None:
    registry = Registry()
    raw = 'quote " slash \\ newline \n end'
    registry.counter("c_total", "c", ("v",)).inc(v=raw)
    assert parse(registry.render()) == {("c_total", (("v", raw),)): 1.0}


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (3.0, "3"),
        (1048576.0, "1048576"),
        (-2.0, "-2"),
        (0.0005, "0.0005"),
        (1.5, "1.5"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_format_value(value: float, text: str) -> None:
    assert format_value(value) == text


def test_unlabelled_metrics_render_zero_before_first_update() -> None:
    registry = Registry()
    registry.counter("c_total", "c")
    registry.histogram("h", "h", (1.0,))
    registry.gauge("g", "g", ("x",))  # labelled: no series until one is set
    assert parse(registry.render()) == {
        ("c_total", ()): 0,
        ("h_bucket", (("le", "1"),)): 0,
        ("h_bucket", (("le", "+Inf"),)): 0,
        ("h_sum", ()): 0,
        ("h_count", ()): 0,
    }


# ---------------------------------------------------------------- histogram


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    hist = Histogram("h", "h", (1.0, 2.0, 4.0))
    for value in (1.0, 1.0, 1.5, 2.0, 3.0, 100.0, -5.0):
        hist.observe(value)
    snap = hist.snapshot()
    assert hist.bounds == (1.0, 2.0, 4.0, math.inf)
    assert snap.cumulative == (3, 5, 6, 7)
    assert snap.count == 7
    assert snap.total == pytest.approx(103.5)


def test_histogram_keeps_explicit_inf_bound_once() -> None:
    assert Histogram("h", "h", (1.0, math.inf)).bounds == (1.0, math.inf)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), max_size=50))
@settings(max_examples=100, deadline=None)
def test_histogram_invariants(values: list[float]) -> None:
    registry = Registry()
    hist = registry.histogram("h", "h", (-10.0, 0.0, 0.5, 1.0, 1e3), ("k",))
    for value in values:
        hist.observe(value, k="v")
    samples = parse(registry.render())
    if not values:
        assert samples == {}  # a labelled histogram has no series until its first observation
        return
    buckets = [v for (name, _), v in samples.items() if name == "h_bucket"]
    assert buckets == sorted(buckets)
    assert samples[("h_bucket", (("k", "v"), ("le", "+Inf")))] == len(values)
    assert samples[("h_count", (("k", "v"),))] == len(values)
    assert samples[("h_sum", (("k", "v"),))] == pytest.approx(math.fsum(values), abs=1e-6)
    for bound in (-10.0, 0.0, 0.5, 1.0, 1e3):
        expected = sum(value <= bound for value in values)
        assert samples[("h_bucket", (("k", "v"), ("le", format_value(bound))))] == expected


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("labels", [{}, {"a": "1"}, {"a": "1", "b": "2", "c": "3"}, {"x": "1"}])
def test_label_names_must_match_declared(labels: dict[str, str]) -> None:
    counter = Counter("c_total", "c", ("a", "b"))
    gauge = Gauge("g", "g", ("a", "b"))
    hist = Histogram("h", "h", (1.0,), ("a", "b"))
    with pytest.raises(ValueError, match="declared"):
        counter.inc(**labels)
    with pytest.raises(ValueError, match="declared"):
        gauge.set(1, **labels)
    with pytest.raises(ValueError, match="declared"):
        hist.observe(1, **labels)


@pytest.mark.parametrize("amount", [-1.0, -1e-9, math.nan])
def test_counter_rejects_negative_increment(amount: float) -> None:
    counter = Counter("c_total", "c")
    with pytest.raises(ValueError, match=">= 0"):
        counter.inc(amount)
    assert counter.value() == 0


def test_gauge_inc_dec_and_counter_value() -> None:
    gauge = Gauge("g", "g", ("k",))
    gauge.set(5, k="a")
    gauge.inc(k="a")
    gauge.dec(3, k="a")
    assert gauge.value(k="a") == 3
    assert gauge.value(k="unseen") == 0


def test_duplicate_registration_rejected() -> None:
    registry = Registry()
    registry.counter("x", "x")
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("x", "x")


@pytest.mark.parametrize(
    ("name", "labels"),
    [("1bad", ()), ("bad-name", ()), ("ok", ("bad-label",)), ("ok", ("__x",)), ("ok", ("a", "a"))],
)
def test_invalid_names_rejected(name: str, labels: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=r"invalid|duplicate"):
        Counter(name, "h", labels)


@pytest.mark.parametrize("buckets", [(2.0, 1.0), (1.0, 1.0), (math.nan,)])
def test_bad_buckets_rejected(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="bucket"):
        Histogram("h", "h", buckets)


def test_histogram_rejects_le_label_and_nan() -> None:
    with pytest.raises(ValueError, match="invalid label"):
        Histogram("h", "h", (1.0,), ("le",))
    with pytest.raises(ValueError, match="NaN"):
        Histogram("h", "h", (1.0,)).observe(math.nan)


# ---------------------------------------------------------------- ServerMetrics


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_server_metrics_end_to_end() -> None:
    clock = FakeClock()
    metrics = ServerMetrics(clock=clock)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/completions", 400)
    metrics.observe_finished(100, 10, 25, 0.05, [0.01, 0.02], 0.5, "stop")
    metrics.observe_finished(300, 20, 75, None, [], 1.5, "length")
    metrics.observe_aborted()
    metrics.set_engine_stats(running=3, waiting=2, kv_used=30, kv_total=120, retractions=4)
    s = parse(metrics.render())

    def get(name: str, **labels: str) -> float:
        return s[("m3serve:" + name, tuple(labels.items()))]

    assert get("request_total", endpoint="/v1/chat/completions", status="200") == 2
    assert get("request_total", endpoint="/v1/completions", status="400") == 1
    assert get("prompt_tokens_total") == 400
    assert get("generation_tokens_total") == 30
    assert get("cached_tokens_total") == 100
    assert get("request_success_total", finish_reason="stop") == 1
    assert get("request_success_total", finish_reason="length") == 1
    assert get("request_aborted_total") == 1
    assert get("time_to_first_token_seconds_count") == 1
    assert get("time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert get("inter_token_latency_seconds_count") == 2
    assert get("e2e_request_latency_seconds_count") == 2
    assert get("e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert get("request_prompt_tokens_bucket", le="256") == 1
    assert get("request_prompt_tokens_bucket", le="1024") == 2
    assert get("request_generation_tokens_bucket", le="16") == 1
    assert get("request_prompt_tokens_bucket", le="1048576") == 2
    assert get("num_running_reqs") == 3
    assert get("num_waiting_reqs") == 2
    assert get("kv_cache_usage_ratio") == pytest.approx(0.25)
    assert get("prefix_cache_hit_rate") == pytest.approx(0.25)
    assert get("num_retractions_total") == 4
    assert get("generation_throughput_tokens_per_s") == 0


def test_throughput_over_sliding_window() -> None:
    clock = FakeClock(1000.0)
    metrics = ServerMetrics(clock=clock)

    def throughput() -> float:
        return parse(metrics.render())[("m3serve:generation_throughput_tokens_per_s", ())]

    clock.now = 1002.0  # 2 s into the server's life: the window is not full yet
    metrics.count_tokens(40)
    assert throughput() == pytest.approx(20.0)
    clock.now = 1020.0
    metrics.count_tokens(30, now=1015.0)
    metrics.count_tokens(70)
    assert throughput() == pytest.approx(10.0)  # 100 tokens in the last 10 s; the 40 aged out
    clock.now = 1025.5
    assert throughput() == pytest.approx(7.0)  # only the 70 at t=1020 remain
    clock.now = 1100.0
    assert throughput() == 0


def test_derived_gauges_handle_empty_denominators() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    metrics.set_engine_stats(running=0, waiting=0, kv_used=0, kv_total=0, retractions=0)
    s = parse(metrics.render())
    assert s[("m3serve:kv_cache_usage_ratio", ())] == 0
    assert s[("m3serve:prefix_cache_hit_rate", ())] == 0
    assert s[("m3serve:generation_throughput_tokens_per_s", ())] == 0


def test_server_metrics_render_is_well_formed_and_typed() -> None:
    text = ServerMetrics(clock=FakeClock()).render()
    parse(text)
    types = dict(re.findall(r"^# TYPE (\S+) (\w+)$", text, re.MULTILINE))
    assert all(name.startswith("m3serve:") for name in types)
    assert types["m3serve:request_total"] == "counter"
    assert types["m3serve:e2e_request_latency_seconds"] == "histogram"
    assert types["m3serve:num_running_reqs"] == "gauge"
    assert len(types) == 17
