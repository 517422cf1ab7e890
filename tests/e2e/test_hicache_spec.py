"""HiCache with speculative decoding (DSpark, random `make-tiny --dspark` draft): the host pool
and the L3 store hold the draft KV beside the target's. A prefix evicted to host (and, in a
replica, one only the store has) comes back with exactly the greedy tokens and acceptance of a
large device pool (the draft proposes the same blocks), reported as cached, and its reloaded
draft KV equals the draft KV a fresh prefill of the prefix writes — under every write policy;
every pool returns to its baseline. A replica without the draft never reads those pages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf_oracle import random_prompt
from helpers.metrics_text import samples
from prometheus_client import generate_latest

from m3serve import Engine
from m3serve.actors.scheduler import SchedulerActor
from m3serve.core.engine_core import EngineCore
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark import target_features
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=1, dspark=True)
VOCAB = SPEC.vocab_size - 64
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PREFIX = random_prompt(700, 40, VOCAB)  # 10 pages of the tiny model's 4-token pages
# Three turns on the prefix (a selective backup needs two hits), one unrelated prompt that
# takes nearly the whole 16-page device pool, then the prefix again.
PROMPTS = [
    *[[*PREFIX, *random_prompt(710 + i, 4, VOCAB)] for i in range(3)],
    random_prompt(720, 48, VOCAB),
    [*PREFIX, *random_prompt(730, 6, VOCAB)],
]
REPLICA = [*PREFIX, *random_prompt(740, 6, VOCAB)]  # a tail the first server never saw
SMALL_POOL = 64  # tokens: the unrelated prompt evicts the prefix from the device
DSPARK = {"speculative_algorithm": "DSPARK", "skip_warmup": True}
POLICIES = ["write_through", "write_back", "write_through_selective"]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


def core_of(engine: Engine) -> tuple[SchedulerActor, EngineCore]:
    actor = next(a for a in engine.async_engine.actors if isinstance(a, SchedulerActor))
    assert actor.core is not None
    return actor, actor.core


def record_proposals(engine: Engine) -> list[list[list[int]]]:
    """Every draft block the engine's proposer proposes from now on, in order: equal draft KV
    gives equal proposals, so equal acceptance whatever the draft."""
    _, core = core_of(engine)
    assert core.spec is not None and core.spec.proposer is not None
    proposer, seen = core.spec.proposer, []
    propose = proposer.propose

    def recording(*args: Any, **kwargs: Any) -> Any:
        proposal = propose(*args, **kwargs)
        seen.append(proposal.tokens.tolist())
        return proposal

    proposer.propose = recording  # type: ignore[method-assign]
    return seen


def generate(engine: Engine, prompt: list[int]) -> tuple[list[int], int, float]:
    """Output ids, cached tokens and the acceptance length of one greedy request."""
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    meta = out["meta_info"]
    return out["output_ids"], meta["cached_tokens"], meta["spec_accept_length"]


@torch.inference_mode()
def assert_prefix_draft_kv_is_a_fresh_prefills(core: EngineCore) -> None:
    """The draft K/V at the prefix's device slots (loaded back from host or L3) equals the
    draft K/V computed from the prefix's target features in one fresh prefill."""
    assert core.spec is not None and core.spec.kv is not None
    proposer = core.spec.proposer
    draft, kv = proposer.draft, core.spec.kv  # type: ignore[union-attr]
    page, n = core.budget.page_size, len(PREFIX)
    pages = core.scheduler.cache.tree.match(PREFIX).pages
    assert len(pages) * page == n, "the prefix is not on the device"
    scratch = KVCache.allocate(core.model.cfg, n // page, torch.float32, "cpu")
    batch = ForwardBatch.build([SeqStep(PREFIX, 0, list(range(n // page)))], page, "cpu")
    features = target_features(core.model, batch, scratch, proposer.layer_ids)  # type: ignore[union-attr]
    want = draft.context(features, torch.arange(n))
    positions = torch.arange(n)
    slots = torch.tensor(pages)[positions // page] * page + positions % page
    for layer in range(len(want.k)):
        torch.testing.assert_close(kv.k[layer][slots], want.k[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv.v[layer][slots], want.v[layer], rtol=1e-4, atol=1e-4)


def assert_pools_at_baseline(core: EngineCore) -> None:
    """Device pages (main K/V, index-K and draft KV share their ids) and host pages: free or
    cached, every copy settled; all free once the cache is dropped — host pages that an L3
    write still reads excepted: those are parked until the host-cache actor's Done."""
    assert core.spec is not None and core.spec.kv is not None
    assert core.spec.kv.k[0].shape[0] == core.kv.layers[0].k.shape[0], "draft pool not aligned"
    scheduler = core.scheduler
    cache = scheduler.cache
    scheduler.idle_check()
    baseline = (scheduler.pool.num_pages, cache.host_pool.num_pages)
    cache.reset()
    parked = cache.storage.parked if cache.storage is not None else 0
    assert cache.reserved_host == 0
    assert (scheduler.pool.num_free, cache.host_pool.num_free + parked) == baseline


Expected = dict[str, tuple[list[int], float, list[list[list[int]]]]]


@pytest.fixture(scope="module")
def expected(path: Path) -> Expected:
    """Large device pool, speculation on: the last prompt's and the replica's tokens,
    acceptance and draft proposals."""
    with Engine(str(path), single_process=True, max_total_tokens=4096, **DSPARK) as engine:
        proposals = record_proposals(engine)
        for prompt in PROMPTS[:-1]:
            generate(engine, prompt)
        proposals.clear()
        last, _, last_accept = generate(engine, PROMPTS[-1])
        last_proposals = list(proposals)
        proposals.clear()
        replica, _, replica_accept = generate(engine, REPLICA)
    return {
        "last": (last, last_accept, last_proposals),
        "replica": (replica, replica_accept, list(proposals)),
    }


def hicache(policy: str, store: Path | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "max_total_tokens": SMALL_POOL,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": policy,
        **DSPARK,
    }
    if store is not None:
        args |= {"hicache_storage_backend": "file", "hicache_storage_dir": str(store)}
    return args


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_evicted_to_host_comes_back_with_its_draft_kv(
    path: Path, expected: Expected, policy: str
) -> None:
    with Engine(str(path), single_process=True, **hicache(policy)) as engine:
        proposals = record_proposals(engine)
        runs = [generate(engine, prompt) for prompt in PROMPTS[:-1]]
        proposals.clear()
        runs.append(generate(engine, PROMPTS[-1]))
        actor, core = core_of(engine)
        assert_prefix_draft_kv_is_a_fresh_prefills(core)
        metrics = samples(generate_latest(actor.metrics.registry).decode())
        assert_pools_at_baseline(core)
        assert core.host is not None
        names = [t.name for t in core.host.pool.layout.tensors]
        assert names.count("draft_k") == names.count("draft_v") == len(core.spec.kv.k)  # type: ignore[union-attr]
    ids, cached, accept = runs[-1]
    assert (ids, accept, proposals) == expected["last"]
    assert proposals, "no verify step ran"
    assert cached == len(PREFIX)  # reloaded from host, reported as cached
    assert metrics["m3serve:hicache_host_hit_tokens_total"] == len(PREFIX)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replica_fetches_a_prefix_with_its_draft_kv_from_the_store(
    path: Path, tmp_path: Path, expected: Expected, policy: str
) -> None:
    store = tmp_path / "l3"
    with Engine(str(path), single_process=True, **hicache(policy, store)) as first:
        for prompt in PROMPTS:
            generate(first, prompt)
    with Engine(str(path), single_process=True, **hicache(policy, store)) as replica:
        proposals = record_proposals(replica)
        ids, cached, accept = generate(replica, REPLICA)
        actor, core = core_of(replica)
        assert_prefix_draft_kv_is_a_fresh_prefills(core)
        metrics = samples(generate_latest(actor.metrics.registry).decode())
        assert_pools_at_baseline(core)
    assert (ids, accept, proposals) == expected["replica"]
    assert cached == len(PREFIX)
    assert metrics["m3serve:hicache_storage_hit_tokens_total"] == len(PREFIX)


def test_a_replica_without_the_draft_never_reads_pages_with_draft_kv(
    path: Path, tmp_path: Path, expected: Expected
) -> None:
    # The store was written with draft KV in its pages; a replica of the same checkpoint
    # without speculation has other page bytes, so other keys: a miss, and its own tokens.
    store = tmp_path / "l3"
    with Engine(str(path), single_process=True, **hicache("write_through", store)) as first:
        for prompt in PROMPTS:
            generate(first, prompt)
    plain = {k: v for k, v in hicache("write_through", store).items() if k not in DSPARK}
    with Engine(str(path), single_process=True, skip_warmup=True, **plain) as replica:
        out = replica.generate(input_ids=REPLICA, sampling_params=GREEDY)
        actor, _ = core_of(replica)
        metrics = samples(generate_latest(actor.metrics.registry).decode())
    assert out["output_ids"] == expected["replica"][0]
    assert out["meta_info"]["cached_tokens"] == 0
    assert metrics["m3serve:hicache_storage_hit_tokens_total"] == 0
