"""`EngineMetrics` reads a real scheduler's load, writes only what changed, and turns the
scheduler's running retraction total into counter increments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from m3serve.actors.engine_metrics import EngineMetrics
from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import SamplingParams

PAGE = 4


def value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value("m3serve:" + name)


def request(rid: str, prompt_len: int) -> Req:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    return Req(rid, list(range(10, 10 + prompt_len)), sampling, frozenset({7}), worker=0)


def test_figures_of_a_real_scheduler() -> None:
    scheduler = Scheduler(SchedArgs(max_running_requests=1), 40, PAGE, radix=True)
    metrics = EngineMetrics()
    metrics.update(scheduler)
    assert value(metrics.registry, "num_running_reqs") == 0
    assert value(metrics.registry, "kv_cache_usage_ratio") == 0
    assert value(metrics.registry, "num_retractions_total") == 0
    scheduler.add(request("a", 10))
    scheduler.add(request("b", 10))
    assert scheduler.schedule() is not None  # admits one: max_running_requests=1
    metrics.update(scheduler)
    used = scheduler.pool.num_pages - scheduler.pool.num_free
    assert used > 0
    assert value(metrics.registry, "num_running_reqs") == 1
    assert value(metrics.registry, "num_waiting_reqs") == 1
    assert value(metrics.registry, "kv_cache_usage_ratio") == pytest.approx(used / 40)
    assert value(metrics.registry, "num_cached_pages") == 0


def fake(
    retracted: int,
    running: int = 0,
    fetched: int | None = None,
    accepts: dict[int, int] | None = None,
) -> SimpleNamespace:
    """A scheduler's figures; `fetched`: tokens its L3 tier fetched (None: no L3 tier);
    `accepts`: verify rows so far by committed length (speculative decoding)."""
    return SimpleNamespace(
        spec_accept_counts=accepts or {},
        running=[object()] * running,
        waiting=[],
        pool=SimpleNamespace(num_pages=10, num_free=10),
        cache=SimpleNamespace(tree=SimpleNamespace(cached_pages=0)),
        retracted=retracted,
        cached_prompt_tokens=0,
        host_hit_tokens=0,
        storage=None if fetched is None else SimpleNamespace(hit_tokens=fetched),
    )


def test_tokens_fetched_from_l3_count_up() -> None:
    metrics = EngineMetrics()
    metrics.update(fake(0))  # type: ignore[arg-type]
    assert value(metrics.registry, "hicache_storage_hit_tokens_total") == 0
    for total in (0, 40, 40, 52):
        metrics.update(fake(0, fetched=total))  # type: ignore[arg-type]
        assert value(metrics.registry, "hicache_storage_hit_tokens_total") == total


def test_acceptance_lengths_are_observed_once_each() -> None:
    metrics = EngineMetrics()
    metrics.update(fake(0, accepts={1: 2, 3: 1}))  # type: ignore[arg-type]
    metrics.update(fake(0, accepts={1: 2, 3: 2, 8: 1}))  # type: ignore[arg-type]
    metrics.update(fake(0, accepts={1: 2, 3: 2, 8: 1}))  # type: ignore[arg-type]
    assert value(metrics.registry, "spec_accept_length_count") == 5
    assert value(metrics.registry, "spec_accept_length_sum") == 1 + 1 + 3 + 3 + 8
    bucket = metrics.registry.get_sample_value
    assert bucket("m3serve:spec_accept_length_bucket", {"le": "1.0"}) == 2
    assert bucket("m3serve:spec_accept_length_bucket", {"le": "7.0"}) == 4


def test_retractions_count_up_by_the_schedulers_increments() -> None:
    metrics = EngineMetrics()
    for total in (0, 2, 2, 5):
        metrics.update(fake(total))  # type: ignore[arg-type]
        assert value(metrics.registry, "num_retractions_total") == total


def test_unchanged_figures_write_nothing() -> None:
    metrics = EngineMetrics()
    metrics.update(fake(1, running=2))  # type: ignore[arg-type]

    def refuse(*_: object) -> None:
        raise AssertionError("wrote an unchanged figure")

    for metric in (metrics.running, metrics.waiting, metrics.kv_usage, metrics.cached_pages):
        metric.set = refuse  # type: ignore[method-assign]
    metrics.retractions.inc = refuse  # type: ignore[method-assign]
    metrics.update(fake(1, running=2))  # type: ignore[arg-type]


def test_each_engine_metrics_has_its_own_registry() -> None:
    first, second = EngineMetrics(), EngineMetrics()
    first.update(fake(0, running=3))  # type: ignore[arg-type]
    assert value(first.registry, "num_running_reqs") == 3
    assert value(second.registry, "num_running_reqs") == 0
