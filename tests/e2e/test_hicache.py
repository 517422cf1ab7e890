"""HiCache end to end: with a device pool too small to keep a shared prefix, the prefix goes to
the host pool and comes back for a later request, which produces exactly the greedy tokens of a
large device pool and reports the reloaded tokens as cached — under every write policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hicache_workload import (
    GREEDY,
    PREFIX,
    PROMPTS,
    SMALL_POOL,
    large_pool_outputs,
)
from helpers.metrics_text import samples
from prometheus_client import generate_latest

from m3serve import Engine
from m3serve.actors.scheduler import SchedulerActor


def serve(path: Path, **server_args: object) -> tuple[list[list[int]], list[int], SchedulerActor]:
    """Each prompt in turn (so each sees the cache the previous ones left): output ids, cached
    tokens, and the engine's scheduler actor (read before the engine closes)."""
    outputs, cached = [], []
    with Engine(str(path), single_process=True, skip_warmup=True, **server_args) as engine:
        for prompt in PROMPTS:
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            outputs.append(out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
        actor = next(a for a in engine.async_engine.actors if isinstance(a, SchedulerActor))
        assert actor.core is not None
        scheduler = actor.core.scheduler
        scheduler.idle_check()  # both tiers' pages add up, no copy in flight on a free page
        baseline = (scheduler.pool.num_pages, scheduler.cache.host_pool.num_pages)
        scheduler.cache.reset()
        assert (scheduler.pool.num_free, scheduler.cache.host_pool.num_free) == baseline
    return outputs, cached, actor


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[list[int]]:
    return large_pool_outputs(model_path)


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_a_prefix_evicted_to_host_comes_back_with_the_same_tokens(
    model_path: Path, expected: list[list[int]], policy: str
) -> None:
    outputs, cached, actor = serve(
        model_path,
        max_total_tokens=SMALL_POOL,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
    )
    assert outputs == expected
    assert cached[1] == cached[2] == len(PREFIX)  # device hits
    assert cached[-1] == len(PREFIX)  # reloaded from host, reported as cached
    metrics = samples(generate_latest(actor.metrics.registry).decode())
    assert metrics["m3serve:hicache_host_hit_tokens_total"] == len(PREFIX)
    assert metrics["m3serve:cached_prompt_tokens_total"] == 2 * len(PREFIX)
    assert metrics["m3serve:hicache_host_cached_pages"] > 0


def test_without_hicache_the_small_pool_recomputes_the_prefix(
    model_path: Path, expected: list[list[int]]
) -> None:
    with Engine(
        str(model_path), single_process=True, skip_warmup=True, max_total_tokens=SMALL_POOL
    ) as engine:
        last = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS][-1]
    assert last["output_ids"] == expected[-1]
    assert last["meta_info"]["cached_tokens"] == 0  # what HiCache saves above
