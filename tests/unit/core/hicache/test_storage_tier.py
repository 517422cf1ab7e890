"""StorageTier with the scheduler and the tiered prefix cache, against a scripted host-cache
actor on in-process mailboxes (a real StorageClient): L3 writes behind finished host backups,
host pages pinned by them, prefetches before admission (found, shared, timed out) and the
actor's death, which fails the requests waiting on a prefetch and drops the host tier."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import pytest

from m3serve.core.hicache import prefetch
from m3serve.core.hicache.keys import page_keys, root_key
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.storage_client import StorageClient
from m3serve.core.hicache.storage_tier import DIED_WHILE_FETCHING, StorageTier
from m3serve.core.req import Phase, Req
from m3serve.core.scheduler import Scheduler
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import (
    Backup,
    Done,
    Error,
    FromHiCache,
    HostPoolReady,
    HostPoolSpec,
    Prefetch,
    SamplingParams,
    StepResult,
    ToHiCache,
)
from m3serve.runtime.transport import InProcChannel

PAGE = 4
ROOT = root_key("test-model", PAGE, "float32")
PATIENCE_S = 5.0
STOP = frozenset({7})


class Actor:
    """The host-cache actor's side of the mailboxes, driven by the test."""

    def __init__(self) -> None:
        requests: InProcChannel[ToHiCache] = InProcChannel()
        replies: InProcChannel[FromHiCache] = InProcChannel()
        self.inbox = requests.inbox()
        self.outbox = replies.outbox()
        self.client = StorageClient(requests.outbox(), replies.inbox())

    async def open(self, num_pages: int) -> None:
        opening = asyncio.create_task(self.client.open(64, num_pages, timeout=PATIENCE_S))
        assert await self.recv() == HostPoolSpec(64, num_pages)
        await self.outbox.send(HostPoolReady("m3s-test-1", 64, num_pages, os.getpid()))
        await opening

    async def recv(self) -> ToHiCache:
        return await asyncio.wait_for(self.inbox.recv(), PATIENCE_S)

    async def done(self, msg: Backup | Prefetch, pages: int) -> None:
        await self.outbox.send(Done(msg.ticket, pages))
        await asyncio.sleep(0)  # the client's reader resolves the ticket


class Setup:
    def __init__(self, actor: Actor, policy: str = "write_through", host: int = 16) -> None:
        self.actor = actor
        self.cache = HiPrefixCache(16, host, PAGE, policy)  # type: ignore[arg-type]
        self.disabled: list[bool] = []
        self.tier = StorageTier(actor.client, self.cache, ROOT, lambda: self.disabled.append(True))
        args = SchedArgs(max_running_requests=4, max_prefill_tokens=64)
        self.scheduler = Scheduler(args, 16, PAGE, True, cache=self.cache, storage=self.tier)

    def finish(self, req: Req) -> None:
        """Run the request's step (one token) and end it, as the engine would."""
        plan = self.scheduler.schedule()
        assert plan is not None
        rows = self.scheduler.inflight[plan.step]
        self.scheduler.process(
            StepResult(step=plan.step, slots=[r.slot for r in rows], tokens=[7] * len(rows))
        )
        assert req.phase is Phase.DONE


def request(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=1), STOP, worker=0)


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


@pytest.fixture
async def actor() -> AsyncIterator[Actor]:
    actor = Actor()
    await actor.open(16)
    yield actor
    await actor.client.close(drain_s=0)


async def test_host_pages_go_on_to_l3_once_their_backup_is_done(actor: Actor) -> None:
    s = Setup(actor)
    prompt = tokens(9)  # two whole pages before the last token: nothing cached, so a fetch
    req = request("a", prompt)
    s.scheduler.add(req)
    fetch = await actor.recv()
    assert isinstance(fetch, Prefetch) and fetch.keys == page_keys(ROOT, prompt[:8], PAGE)
    await actor.done(fetch, 0)
    s.finish(req)  # write_through: its two pages are backed up to host as they are cached
    s.scheduler.schedule()  # the next round sends the L3 write
    backup = await actor.recv()
    assert isinstance(backup, Backup)
    assert backup.keys == page_keys(ROOT, prompt[:8], PAGE)
    (node,) = s.cache.tree.path(prompt[:8])
    assert backup.host_pages == node.host
    assert all(actor.client.busy(h) for h in node.host)
    await actor.done(backup, 2)
    assert not any(actor.client.busy(h) for h in node.host)
    s.scheduler.idle_check()


async def test_pages_an_l3_write_reads_are_not_reused_until_it_is_done(actor: Actor) -> None:
    s = Setup(actor, host=2)
    first = request("a", tokens(9))
    s.scheduler.add(first)
    await actor.done(await actor.recv(), 0)  # type: ignore[arg-type]
    s.finish(first)
    s.scheduler.schedule()
    backup = await actor.recv()
    assert isinstance(backup, Backup)
    # A second prompt needs the only two host pages for its fetch: they are pinned, so none.
    second = request("b", tokens(9, base=500))
    s.scheduler.add(second)
    assert second.fetch is None and s.cache.tree.host_cached_pages == 2
    assert s.cache.reserve_host(1) is None
    s.finish(second)
    # A reset lets go of the pinned pages: they are parked, not freed, until the write ends.
    s.cache.reset()
    assert s.cache.host_pool.num_free == 0 and s.cache.storage is not None
    assert s.cache.storage.parked == 2
    s.cache.check()
    await actor.done(backup, 2)
    s.scheduler.schedule()
    assert s.cache.host_pool.num_free == 2
    s.cache.check()


async def test_a_prefix_found_in_l3_is_loaded_back_and_counted_as_cached(actor: Actor) -> None:
    s = Setup(actor)
    prompt = tokens(21)  # five whole pages before the last token
    req, other = request("a", prompt), request("b", tokens(4, base=900))  # b: no whole page
    s.scheduler.add(req)
    s.scheduler.add(other)
    assert other.fetch is None
    fetch = await actor.recv()
    assert isinstance(fetch, Prefetch) and len(fetch.host_pages) == 5
    assert s.cache.reserved_host == 5
    # The other request does not wait for this fetch.
    plan = s.scheduler.schedule()
    assert plan is not None and [r.rid for r in s.scheduler.running] == ["b"]
    await actor.done(fetch, 3)  # L3 holds the first three pages
    plan = s.scheduler.schedule()
    assert plan is not None and req in s.scheduler.running
    assert req.cached_tokens == 3 * PAGE and s.tier.hit_tokens == 3 * PAGE
    assert s.scheduler.host_hit_tokens == 3 * PAGE
    (load,) = plan.loads
    assert load.host == fetch.host_pages[:3]
    assert s.cache.reserved_host == 0
    assert s.cache.host_pool.num_free == 16 - 3  # the two pages not found went back


async def test_requests_sharing_a_missing_prefix_share_one_fetch(actor: Actor) -> None:
    s = Setup(actor)
    a, b = request("a", tokens(13)), request("b", [*tokens(12), 5, 6])
    s.scheduler.add(a)
    s.scheduler.add(b)
    assert a.fetch is b.fetch
    fetch = await actor.recv()
    await actor.done(fetch, 3)  # type: ignore[arg-type]
    s.scheduler.schedule()
    assert {r.rid for r in s.scheduler.running} == {"a", "b"}
    assert a.cached_tokens == b.cached_tokens == 12


async def test_a_fetch_past_its_deadline_lets_the_request_compute(
    actor: Actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetch, "FETCH_TIMEOUT_S", -1.0)
    s = Setup(actor)
    req = request("a", tokens(13))
    s.scheduler.add(req)
    fetch = await actor.recv()
    s.finish(req)
    assert req.cached_tokens == 0  # computed, not waited for
    await actor.done(fetch, 3)  # type: ignore[arg-type]
    s.scheduler.schedule()  # the late pages were cached meanwhile: they go back
    s.cache.check()
    assert s.tier.hit_tokens == 0 and s.cache.reserved_host == 0


async def test_the_actors_death_fails_the_waiting_request_and_drops_the_host_tier(
    actor: Actor, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup(actor)
    cached = request("a", tokens(9))
    s.scheduler.add(cached)
    await actor.done(await actor.recv(), 0)  # type: ignore[arg-type]
    s.finish(cached)  # two pages on the device, backed up to host
    s.cache._evict_device(2)  # now only on host
    assert s.cache.tree.host_cached_pages == 2 and s.cache.tree.cached_pages == 0
    waiting = request("b", tokens(21, base=300))
    s.scheduler.add(waiting)
    with caplog.at_level(logging.ERROR):
        await actor.outbox.send(Error(None, "the host-cache actor stopped", actor="hicache"))
        await asyncio.sleep(0.01)
        assert s.scheduler.schedule() is None
    assert "HiCache disabled:" in caplog.text and s.disabled == [True]
    errors = s.scheduler.take_errors()
    assert errors is not None
    (error,) = errors.errors[0]
    assert (error.rid, error.message, error.code) == ("b", DIED_WHILE_FETCHING, 500)
    assert s.cache.tree.host_cached_pages == 0 and not s.cache.host_enabled
    s.scheduler.idle_check()
    # Later requests run on the device tier alone: no fetch, no backup, no load-back.
    later = request("c", tokens(9))
    s.scheduler.add(later)
    assert later.fetch is None
    s.finish(later)
    s.scheduler.idle_check()
    assert s.tier.poll() == [] and not s.tier.has_work


async def test_a_fetch_makes_room_from_other_prefixes_than_the_one_it_extends(
    actor: Actor,
) -> None:
    s = Setup(actor, host=4)
    older, newer = tokens(9, base=100), tokens(9, base=500)
    for prompt in (older, newer):
        await cache_prompt(s, prompt)
    s.cache._evict_device(4)  # both only on host now, the full host pool
    extends = request("c", [*older[:8], *tokens(9, base=900)])  # two more pages to fetch
    s.scheduler.add(extends)
    assert isinstance(await actor.recv(), Prefetch)
    assert s.cache.tree.cached_length(older[:8]) == 8  # the prefix it extends stays
    assert s.cache.tree.cached_length(newer[:8]) == 0  # though the other one was newer
    s.cache.check()


async def cache_prompt(s: Setup, prompt: list[int]) -> None:
    """Run a prompt through (its fetch finds nothing) and let its L3 write finish."""
    req = request(f"r{prompt[0]}", prompt)
    s.scheduler.add(req)
    fetch = await s.actor.recv()
    assert isinstance(fetch, Prefetch)
    await s.actor.done(fetch, 0)
    s.finish(req)
    s.scheduler.schedule()
    backup = await s.actor.recv()
    assert isinstance(backup, Backup)
    await s.actor.done(backup, len(backup.keys))


async def test_without_l3_the_tier_only_watches_the_actor(actor: Actor) -> None:
    cache = HiPrefixCache(16, 16, PAGE)
    disabled: list[bool] = []
    tier = StorageTier(actor.client, cache, None, lambda: disabled.append(True))
    assert cache.storage is None and tier.fetches is None and tier.poll() == []
    await actor.outbox.send(Error(None, "the host-cache actor stopped", actor="hicache"))
    await asyncio.sleep(0.01)
    assert tier.poll() == [] and disabled == [True] and not cache.host_enabled
