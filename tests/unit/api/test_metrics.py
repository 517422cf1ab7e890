"""The `/metrics` text `ServerMetrics` renders: series names, labels, bucket lines, `_sum` and
`_count`, counters' `_total`, no `_created`; the derived gauges; what observations refuse; and
the engine's families rendered after the API's."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.actors.engine_metrics import EngineMetrics
from m3serve.api.metrics import (
    CONTENT_TYPE,
    E2E_BUCKETS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    ServerMetrics,
)

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
# A label value: any characters but an unescaped quote, backslash or newline.
LABEL_PAIR = rf'({LABEL_NAME})="((?:[^"\\\n]|\\[\\"n])*)"'
SAMPLE = re.compile(rf"({METRIC_NAME})(?:\{{((?:{LABEL_PAIR},?)*)\}})? (\S+)")
Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

# Every family the API's registry exposes, with its type.
API_FAMILIES = {
    "m3serve:request_total": "counter",
    "m3serve:prompt_tokens_total": "counter",
    "m3serve:generation_tokens_total": "counter",
    "m3serve:cached_tokens_total": "counter",
    "m3serve:request_success_total": "counter",
    "m3serve:request_aborted_total": "counter",
    "m3serve:time_to_first_token_seconds": "histogram",
    "m3serve:inter_token_latency_seconds": "histogram",
    "m3serve:e2e_request_latency_seconds": "histogram",
    "m3serve:request_prompt_tokens": "histogram",
    "m3serve:request_generation_tokens": "histogram",
    "m3serve:prefix_cache_hit_rate": "gauge",
    "m3serve:generation_throughput_tokens_per_s": "gauge",
}
ENGINE_FAMILIES = {
    "m3serve:num_running_reqs": "gauge",
    "m3serve:num_waiting_reqs": "gauge",
    "m3serve:kv_cache_usage_ratio": "gauge",
    "m3serve:num_cached_pages": "gauge",
    "m3serve:num_retractions_total": "counter",
    "m3serve:kernel_compiles_after_ready_total": "counter",
    "m3serve:cached_prompt_tokens_total": "counter",
    "m3serve:hicache_host_hit_tokens_total": "counter",
    "m3serve:hicache_storage_hit_tokens_total": "counter",
    "m3serve:hicache_host_cached_pages": "gauge",
    "m3serve:hicache_host_usage_ratio": "gauge",
    "m3serve:spec_accept_length": "histogram",
}


def parse(text: str) -> Samples:
    """A strict little parser for the text format: every line is HELP, TYPE or a sample, and
    each sample belongs to the family whose TYPE line came last."""
    assert text.endswith("\n")
    samples: Samples = {}
    family = ""
    for line in text.splitlines():
        if line.startswith("# "):
            match = re.fullmatch(rf"# (HELP ({METRIC_NAME}) .*|TYPE ({METRIC_NAME}) \w+)", line)
            assert match, line
            family = match.group(3) or family
            continue
        match = SAMPLE.fullmatch(line)
        assert match, f"not a sample line: {line!r}"
        name, body, value = match.group(1), match.group(2) or "", match.group(5)
        assert name == family or name.removeprefix(family) in ("_bucket", "_sum", "_count"), line
        labels = tuple((n, _unescape(v)) for n, v in re.findall(LABEL_PAIR, body))
        key = (name, labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)  # float() accepts "+Inf" and "NaN"
    return samples


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def families(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\w+)$", text, re.MULTILINE))


def bounds(samples: Samples, histogram: str) -> list[float]:
    """The `le` bounds of one label-less histogram's bucket lines, in the order rendered."""
    return [float(dict(labels)["le"]) for name, labels in samples if name == histogram + "_bucket"]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_scheduler(
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    pages: int = 100,
    cached: int = 0,
    retracted: int = 0,
) -> SimpleNamespace:
    """What `EngineMetrics.update` reads of the core's Scheduler."""
    return SimpleNamespace(
        running=[object()] * running,
        waiting=[object()] * waiting,
        pool=SimpleNamespace(num_pages=pages, num_free=free),
        cache=SimpleNamespace(tree=SimpleNamespace(cached_pages=cached)),
        retracted=retracted,
        cached_prompt_tokens=0,
        host_hit_tokens=0,
        spec_accept_counts={},
        storage=None,
    )


# ---------------------------------------------------------------- the exposition


def test_exposed_families_types_and_content_type() -> None:
    text = ServerMetrics(clock=FakeClock()).render()
    parse(text)
    assert families(text) == API_FAMILIES
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_counters_end_in_total_and_no_created_series_appear() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    metrics.observe_request("/v1/completions", 200)
    metrics.observe_finished(10, 2, 0, 0.1, [0.01], 0.2, "stop")
    metrics.observe_aborted()
    engine = EngineMetrics()
    engine.update(fake_scheduler(retracted=1))
    text = metrics.render(engine.registry)
    assert "_created" not in text
    assert "# TYPE m3serve:request_total counter\n" in text
    assert 'm3serve:request_total{endpoint="/v1/completions",status="200"} 1.0\n' in text
    assert "m3serve:request_aborted_total 1.0\n" in text
    assert "# TYPE m3serve:num_retractions_total counter\n" in text
    assert "m3serve:num_retractions_total 1.0\n" in text


def test_histograms_render_todays_bucket_bounds_sum_and_count() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    metrics.observe_finished(300, 20, 0, 0.05, [0.01, 0.02], 1.5, "length")
    text = metrics.render()
    s = parse(text)
    for name, buckets in [
        ("time_to_first_token_seconds", LATENCY_BUCKETS),
        ("inter_token_latency_seconds", LATENCY_BUCKETS),
        ("e2e_request_latency_seconds", E2E_BUCKETS),
        ("request_prompt_tokens", TOKEN_BUCKETS),
        ("request_generation_tokens", TOKEN_BUCKETS),
    ]:
        assert bounds(s, "m3serve:" + name) == [*buckets, math.inf]
    # The exact lines of one histogram: cumulative buckets ("le" inclusive), then count and sum.
    prompt = [line for line in text.splitlines() if "m3serve:request_prompt_tokens" in line]
    le = ["1.0", "4.0", "16.0", "64.0", "256.0", "1024.0", "4096.0", "16384.0", "65536.0"]
    le += ["262144.0", "1.048576e+06", "+Inf"]
    counts = ["0.0"] * 5 + ["1.0"] * 7
    assert prompt == [
        "# HELP m3serve:request_prompt_tokens Prompt tokens per finished request",
        "# TYPE m3serve:request_prompt_tokens histogram",
        *(
            f'm3serve:request_prompt_tokens_bucket{{le="{b}"}} {c}'
            for b, c in zip(le, counts, strict=True)
        ),
        "m3serve:request_prompt_tokens_count 1.0",
        "m3serve:request_prompt_tokens_sum 300.0",
    ]
    assert s[("m3serve:inter_token_latency_seconds_bucket", (("le", "0.01"),))] == 1
    assert s[("m3serve:inter_token_latency_seconds_bucket", (("le", "0.02"),))] == 2


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=30))
@settings(max_examples=50, deadline=None)
def test_histogram_invariants(values: list[float]) -> None:
    metrics = ServerMetrics(clock=FakeClock())
    for value in values:
        metrics.observe_finished(1, 1, 0, None, [], value, "stop")
    s = parse(metrics.render())
    name = "m3serve:e2e_request_latency_seconds"
    cumulative = [v for (n, _), v in s.items() if n == name + "_bucket"]
    assert cumulative == sorted(cumulative)
    assert s[(name + "_bucket", (("le", "+Inf"),))] == len(values)
    assert s[(name + "_count", ())] == len(values)
    assert s[(name + "_sum", ())] == pytest.approx(math.fsum(values), abs=1e-6)
    for (n, labels), count in s.items():
        if n == name + "_bucket":
            bound = float(dict(labels)["le"])
            assert count == sum(value <= bound for value in values)


def test_label_values_are_escaped_and_round_trip() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    raw = 'quote " slash \\ newline \n end'
    metrics.observe_request(raw, 418)
    metrics.observe_finished(1, 1, 0, None, [], 0.1, raw)
    s = parse(metrics.render())
    assert s[("m3serve:request_total", (("endpoint", raw), ("status", "418")))] == 1
    assert s[("m3serve:request_success_total", (("finish_reason", raw),))] == 1


def test_labelled_series_appear_only_once_observed() -> None:
    s = parse(ServerMetrics(clock=FakeClock()).render())
    assert not [name for name, labels in s if labels and name.endswith("_total")]
    assert s[("m3serve:prompt_tokens_total", ())] == 0
    assert s[("m3serve:e2e_request_latency_seconds_count", ())] == 0


def test_each_server_metrics_has_its_own_registry() -> None:
    first, second = ServerMetrics(clock=FakeClock()), ServerMetrics(clock=FakeClock())
    first.observe_request("/health", 200)
    assert "m3serve:request_total{" in first.render()
    assert "m3serve:request_total{" not in second.render()
    # prometheus_client's process-wide registry is left alone.
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("m3serve:")]


# ---------------------------------------------------------------- what observations refuse


@pytest.mark.parametrize(
    "latencies",
    [
        {"ttft_s": math.nan, "itl_s": [], "e2e_s": 1.0},
        {"ttft_s": 0.1, "itl_s": [0.01, math.nan], "e2e_s": 1.0},
        {"ttft_s": None, "itl_s": [], "e2e_s": math.nan},
    ],
    ids=["ttft", "itl", "e2e"],
)
def test_nan_latency_is_refused_and_records_nothing(latencies: dict[str, object]) -> None:
    metrics = ServerMetrics(clock=FakeClock())
    before = metrics.render()
    with pytest.raises(ValueError, match="NaN"):
        metrics.observe_finished(10, 2, 0, finish_reason="stop", **latencies)  # type: ignore[arg-type]
    assert metrics.render() == before


@pytest.mark.parametrize("counts", [(-1, 0, 0), (0, -1, 0), (0, 0, -1)])
def test_negative_token_counts_are_refused_and_record_nothing(counts: tuple[int, ...]) -> None:
    metrics = ServerMetrics(clock=FakeClock())
    before = metrics.render()
    with pytest.raises(ValueError, match=">= 0"):
        metrics.observe_finished(*counts, None, [], 0.1, "stop")
    assert metrics.render() == before


# ---------------------------------------------------------------- the server's set


def test_server_metrics_end_to_end() -> None:
    clock = FakeClock()
    metrics = ServerMetrics(clock=clock)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/completions", 400)
    metrics.observe_finished(100, 10, 25, 0.05, [0.01, 0.02], 0.5, "stop")
    metrics.observe_finished(300, 20, 75, None, [], 1.5, "length")
    metrics.observe_aborted()
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
    assert get("request_prompt_tokens_bucket", le="256.0") == 1
    assert get("request_prompt_tokens_bucket", le="1024.0") == 2
    assert get("request_generation_tokens_bucket", le="16.0") == 1
    assert get("request_prompt_tokens_bucket", le="1.048576e+06") == 2
    assert get("prefix_cache_hit_rate") == pytest.approx(0.25)
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


def test_throughput_help_names_the_window() -> None:
    text = ServerMetrics(clock=FakeClock(), window_s=30.0).render()
    assert (
        "# HELP m3serve:generation_throughput_tokens_per_s "
        "Generated tokens per second over the last 30 s\n"
    ) in text


def test_derived_gauges_handle_empty_denominators() -> None:
    engine = EngineMetrics()
    engine.update(fake_scheduler(free=0, pages=0))
    s = parse(ServerMetrics(clock=FakeClock()).render(engine.registry))
    assert s[("m3serve:kv_cache_usage_ratio", ())] == 0
    assert s[("m3serve:prefix_cache_hit_rate", ())] == 0
    assert s[("m3serve:generation_throughput_tokens_per_s", ())] == 0


def test_engine_families_follow_the_apis() -> None:
    engine = EngineMetrics()
    scheduler = fake_scheduler(running=3, waiting=2, free=90, pages=120, cached=7, retracted=4)
    engine.update(scheduler, compiles_after_ready=2)
    text = ServerMetrics(clock=FakeClock()).render(engine.registry)
    s = parse(text)
    assert list(families(text).items()) == [*API_FAMILIES.items(), *ENGINE_FAMILIES.items()]
    assert s[("m3serve:num_running_reqs", ())] == 3
    assert s[("m3serve:num_waiting_reqs", ())] == 2
    assert s[("m3serve:kv_cache_usage_ratio", ())] == pytest.approx(0.25)
    assert s[("m3serve:num_cached_pages", ())] == 7
    assert s[("m3serve:num_retractions_total", ())] == 4
    assert s[("m3serve:kernel_compiles_after_ready_total", ())] == 2
