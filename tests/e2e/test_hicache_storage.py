"""HiCache L3 end to end: a server writes its host pages on to the file store behind their
backups; a second server (a replica) started on the same directory finds a prefix that is only
there, fetches it, and produces exactly the greedy tokens of a large device pool, reporting the
fetched tokens as cached — under every write policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.hf_oracle import random_prompt
from helpers.hicache_workload import GREEDY, PREFIX, PROMPTS, SMALL_POOL, VOCAB
from helpers.metrics_text import samples
from prometheus_client import generate_latest

from m3serve import Engine
from m3serve.actors.scheduler import SchedulerActor

# The first server: the HiCache workload (the prefix evicted from the small device pool, so that
# every policy has backed it up, then asked for again).
FIRST = PROMPTS
# The replica: the prefix with a tail that the first server never saw.
REPLICA = [*PREFIX, *random_prompt(740, 6, VOCAB)]


def hicache(store: Path, policy: str) -> dict[str, Any]:
    return {
        "max_total_tokens": SMALL_POOL,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": policy,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(store),
    }


def metrics_of(engine: Engine) -> dict[str, float]:
    actor = next(a for a in engine.async_engine.actors if isinstance(a, SchedulerActor))
    return samples(generate_latest(actor.metrics.registry).decode())


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[int]:
    with Engine(str(model_path), single_process=True, skip_warmup=True) as engine:
        return engine.generate(input_ids=REPLICA, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_a_replica_fetches_a_prefix_only_the_store_has(
    model_path: Path, tmp_path: Path, expected: list[int], policy: str
) -> None:
    store = tmp_path / "l3"
    with Engine(
        str(model_path), single_process=True, skip_warmup=True, **hicache(store, policy)
    ) as first:
        for prompt in FIRST:
            first.generate(input_ids=prompt, sampling_params=GREEDY)
        assert metrics_of(first)["m3serve:hicache_storage_hit_tokens_total"] == 0
    # Shutdown sent the last writes: every page of the prefix is a file now.
    assert len([p for p in store.glob("*/*") if not p.name.startswith(".")]) >= 10
    with Engine(
        str(model_path), single_process=True, skip_warmup=True, **hicache(store, policy)
    ) as replica:
        out = replica.generate(input_ids=REPLICA, sampling_params=GREEDY)
        metrics = metrics_of(replica)
    assert out["output_ids"] == expected
    assert out["meta_info"]["cached_tokens"] == len(PREFIX)
    assert metrics["m3serve:hicache_storage_hit_tokens_total"] == len(PREFIX)
    assert metrics["m3serve:hicache_host_hit_tokens_total"] == len(PREFIX)
