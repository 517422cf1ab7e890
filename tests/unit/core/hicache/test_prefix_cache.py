"""HiPrefixCache (m3serve.core.hicache.prefix_cache): the tiered prefix cache.

Crafted cases pin down each write policy, load-back and host eviction; a state machine then runs
random multi-turn workloads over small device and host pools with copies that run late (a FIFO
standing in for the executor), with simulated KV contents on both tiers, so that a page freed,
reused or read while a copy still touches it shows up as wrong KV.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from m3serve.core.hicache.prefix_cache import HiPrefixCache, WritePolicy
from m3serve.core.hicache.tickets import CopyTracker, Ticket
from m3serve.core.kvcache.hiradix import HiNode
from m3serve.core.kvcache.radix import Match

PS = 2
POLICIES: list[WritePolicy] = ["write_through", "write_back", "write_through_selective"]


def seq(*pages: int) -> list[int]:
    """Tokens of whole 2-token pages, each named by one number: seq(1, 2) == [10, 11, 20, 21]."""
    return [token for page in pages for token in (10 * page, 10 * page + 1)]


class LateCopies:
    """The executor, played by a FIFO: copies run when the test says, or when one is waited on
    (then every copy queued before it runs first, as on the real executor). `device` and `host`
    are the tiers' simulated KV: the tokens each page holds."""

    def __init__(self) -> None:
        self.queue: deque[Ticket] = deque()
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}
        self.tracker = CopyTracker(submit=self.queue.append, before_wait=self.run_until)

    def send_loads(self, cache: HiPrefixCache) -> None:
        """What planning a step does: its load-backs join the queue in order."""
        for copy in cache.take_loads():
            self.queue.append(self.tracker.get(copy.op))

    def run(self, n: int | None = None) -> None:
        while self.queue and (n is None or n > 0):
            ticket = self.queue.popleft()
            for d, h in zip(ticket.device, ticket.host, strict=True):
                if ticket.kind == "backup":
                    self.host[h] = self.device.get(d, ())
                else:
                    self.device[d] = self.host.get(h, ())
            ticket.settle()
            n = None if n is None else n - 1

    def run_until(self, ticket: Ticket) -> None:
        while not ticket.issued:
            assert self.queue, "waited on a copy nobody queued"
            self.run(1)


def make(policy: WritePolicy, device: int = 8, host: int = 16) -> tuple[HiPrefixCache, LateCopies]:
    copies = LateCopies()
    return HiPrefixCache(device, host, PS, policy, copies.tracker), copies


def admit(cache: HiPrefixCache, copies: LateCopies, tokens: list[int]) -> tuple[Match, list[int]]:
    """Acquire, load back, allocate the rest, 'compute' the new pages; returns (match, pages)."""
    match = cache.acquire(tokens)
    loaded = cache.load_back(match)
    assert loaded is not None
    copies.send_loads(cache)
    own = cache.alloc(-(-len(tokens) // PS) - len(loaded.pages))
    assert own is not None
    pages = [*loaded.pages, *own]
    for i in range(len(loaded.pages), len(pages)):
        copies.device[pages[i]] = tuple(tokens[i * PS : (i + 1) * PS])
    return loaded, pages


def fill_device(cache: HiPrefixCache, copies: LateCopies, *names: int) -> None:
    """Run one request per name (one page each) to push older prefixes off the device."""
    for name in names:
        tokens = [*seq(name, name + 50), 7]
        match, pages = admit(cache, copies, tokens)
        cache.release(tokens, pages, match)


def test_write_through_backs_up_on_insert_and_an_evicted_prefix_loads_back() -> None:
    cache, copies = make("write_through", device=6)
    prompt = [*seq(1, 2, 3), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)
    assert cache.tree.host_cached_pages == 3 and len(copies.queue) == 1  # queued, not run yet
    copies.run()
    fill_device(cache, copies, 4, 6)  # 2 x 3 pages: the prefix leaves the device
    again = cache.acquire([*seq(1, 2, 3), 5])
    assert again.pages == [] and [len(n.host) for n in again.host] == [3]
    loaded = cache.load_back(again)
    assert loaded is not None and loaded.num_tokens == 6
    copies.send_loads(cache)
    cache.check()
    copies.run()
    assert [copies.device[p] for p in loaded.pages] == [tuple(seq(i)) for i in (1, 2, 3)]
    cache.release([*seq(1, 2, 3), 5], loaded.pages, loaded)
    cache.check()


def test_write_back_copies_only_when_the_device_evicts() -> None:
    cache, copies = make("write_back", device=6)
    prompt = [*seq(1, 2), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)
    assert cache.tree.host_cached_pages == 0 and not copies.queue
    fill_device(cache, copies, 4, 6)  # evicting [1, 2] waits for its backup
    assert cache.tree.host_cached_pages >= 2
    again = cache.acquire([*seq(1, 2), 5])
    assert [len(n.host) for n in again.host] == [2]
    cache.release(seq(), [], again)
    cache.check()


def test_write_through_selective_waits_for_the_second_hit() -> None:
    cache, copies = make("write_through_selective", device=12)
    prompt = [*seq(1, 2), 9]
    for hits in range(3):
        match, pages = admit(cache, copies, prompt)
        cache.release(prompt, pages, match)
        backed = cache.tree.host_cached_pages
        assert backed == (2 if hits >= 2 else 0), hits
    cache.check()


def test_without_a_host_copy_an_evicted_prefix_is_gone() -> None:
    cache, copies = make("write_through_selective", device=6)
    prompt = [*seq(1, 2), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)
    fill_device(cache, copies, 4, 6)
    assert cache.acquire([*seq(1, 2), 5]).num_tokens == 0
    assert cache.tree.host_cached_pages == 0


def test_host_eviction_drops_the_oldest_host_only_prefix() -> None:
    cache, copies = make("write_through", device=4, host=4)
    for name in (1, 3, 5):
        tokens = [*seq(name, name + 1), 9]
        match, pages = admit(cache, copies, tokens)
        cache.release(tokens, pages, match)
    copies.run()
    cache.check()
    assert cache.acquire([*seq(1, 2), 0]).num_tokens == 0  # oldest: gone from both tiers
    hit = cache.acquire([*seq(3, 4), 0])
    assert len(hit.pages) + sum(len(n.host) for n in hit.host) == 2


def test_a_page_is_never_freed_while_its_copy_is_in_flight() -> None:
    cache, copies = make("write_through", device=4, host=8)
    prompt = [*seq(1, 2), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)  # backup queued, not run
    busy_device, busy_host = cache.copies.in_flight()
    assert busy_device == {0, 1} and len(busy_host) == 2
    with pytest.raises(RuntimeError, match="while a copy uses them"):
        cache.pool.free([0])
    (backup,) = copies.queue
    fill_device(cache, copies, 4, 6)  # evicting the prefix first waits for (runs) its backup
    assert backup.done() and backup not in copies.queue
    cache.check()


def test_pages_fetched_into_host_memory_join_the_tree_and_load_back() -> None:
    cache, copies = make("write_through", device=8, host=8)
    prompt = [*seq(1, 2), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)  # [1, 2] cached (and backed up)
    copies.run()
    host = cache.reserve_host(3)  # what an L3 fetch of [1, 2, 3] does: pages, bytes, tree
    assert host is not None
    for i, page in enumerate(host):
        copies.host[page] = tuple(seq(i + 1))
    cache.add_host_prefix(seq(1, 2, 3), host)  # [1, 2] were cached: those two go back
    cache.check()
    assert cache.tree.host_cached_pages == 3
    again = cache.acquire([*seq(1, 2, 3), 5])
    assert len(again.pages) == 2 and [len(n.host) for n in again.host] == [1]
    loaded = cache.load_back(again)
    assert loaded is not None
    copies.send_loads(cache)
    copies.run()
    assert copies.device[loaded.pages[2]] == tuple(seq(3))
    cache.release([*seq(1, 2, 3), 5], loaded.pages, loaded)
    unused = cache.reserve_host(1)
    assert unused is not None
    cache.release_host(unused)
    cache.check()


def test_fetched_pages_join_after_the_cached_prefix_and_never_after_a_gap() -> None:
    cache, copies = make("write_back", device=8, host=8)
    prompt = [*seq(1, 2), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)  # [1, 2] on the device, no host copy
    host = cache.reserve_host(2)
    assert host is not None
    assert cache.add_host_prefix(seq(1, 2, 3, 4), host, start=2) == 2  # pages 3 and 4
    again = cache.acquire([*seq(1, 2, 3, 4), 5])
    assert len(again.pages) == 2 and [n.host for n in again.host] == [host]
    cache.release(seq(1, 2), again.pages, again)
    gap = cache.reserve_host(1)
    assert gap is not None
    assert cache.add_host_prefix(seq(7, 8), gap, start=1) == 0  # [7] is cached nowhere
    assert cache.host_pool.is_free(gap[0]) and cache.reserved_host == 0
    cache.check()


def test_without_its_host_pool_the_cache_drops_the_host_tier_and_serves_on() -> None:
    cache, copies = make("write_through", device=6)
    prompt = [*seq(1, 2, 3), 9]
    match, pages = admit(cache, copies, prompt)
    cache.release(prompt, pages, match)
    copies.run()
    fill_device(cache, copies, 4)  # [1, 2, 3] partly host-only now, [4, 54] on both tiers
    assert cache.tree.host_cached_pages == 5
    assert cache.disable_host() == 5
    cache.check()
    assert cache.tree.host_cached_pages == 0 and cache.reserve_host(1) is None
    left = cache.acquire([*seq(1, 2, 3), 5])
    assert left.host == ()  # host-only nodes are gone
    cache.release(seq(1, 2, 3)[: left.num_tokens], left.pages, left)
    fill_device(cache, copies, 6)  # no backup is made any more
    assert not copies.queue
    cache.check()


# ------------------------------------------------------------------------------ random


@dataclass
class Request:
    tokens: list[int]
    pages: list[int]
    match: Match


class TieredMachine(RuleBasedStateMachine):
    """Multi-turn sessions (each turn extends an earlier prompt) through a HiPrefixCache whose
    copies run late; KV contents are checked on both tiers."""

    policy: WritePolicy = "write_through"

    @initialize(device=st.integers(4, 8), host=st.integers(8, 24))
    def start(self, device: int, host: int) -> None:
        self.cache, self.copies = make(self.policy, device, host)
        self.live: list[Request] = []
        self.history: list[list[int]] = [[]]

    def holds(
        self, pages: dict[int, tuple[int, ...]], page: int, tokens: list[int], i: int
    ) -> bool:
        return pages.get(page) == tuple(tokens[i * PS : (i + 1) * PS])

    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def turn(self, data: st.DataObject, extra: list[int]) -> None:
        before = data.draw(st.sampled_from(self.history), label="earlier turn")
        prompt = [*before, *extra]
        match = self.cache.acquire(prompt)
        need = -(-len(prompt) // PS) - len(match.pages)
        if need > self.cache.available_pages:
            self.cache.release(prompt[: match.num_tokens], match.pages, match)
            return
        loaded = self.cache.load_back(match)
        assert loaded is not None
        self.copies.send_loads(self.cache)
        own = self.cache.alloc(-(-len(prompt) // PS) - len(loaded.pages))
        assert own is not None
        req = Request(prompt, [*loaded.pages, *own], loaded)
        for i in range(len(loaded.pages), len(req.pages)):
            self.copies.device[req.pages[i]] = tuple(prompt[i * PS : (i + 1) * PS])
        self.live.append(req)

    @rule(n=st.integers(1, 3))
    def run_copies(self, n: int) -> None:
        self.copies.run(n)

    @precondition(lambda self: len(self.live) > 1)
    @rule()
    def finish_oldest(self) -> None:
        self.finish(self.live[0])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1), label="request")]
        if len(req.tokens) == len(req.pages) * PS:
            pages = self.cache.alloc(1)
            if pages is None:
                self.finish(req)  # retracted
                return
            req.pages.extend(pages)
        req.tokens.append(token)
        i = len(req.tokens) - 1
        self.copies.device[req.pages[i // PS]] = tuple(req.tokens[i // PS * PS : i + 1])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        self.finish(self.live[data.draw(st.integers(0, len(self.live) - 1), label="request")])

    def finish(self, req: Request) -> None:
        self.copies.run()  # the steps that read its loaded pages ran before it finished
        for i, page in enumerate(req.pages[: len(req.tokens) // PS]):
            assert self.holds(self.copies.device, page, req.tokens, i), "wrong KV in a request"
        self.cache.release(req.tokens, req.pages, req.match)
        self.live.remove(req)
        self.history.append(req.tokens)

    @invariant()
    def accounted_and_correct(self) -> None:
        self.cache.check()
        for node in self.nodes():
            prefix = list(node.key)
            unsettled = node.ticket is not None and not node.ticket.issued
            for i, page in enumerate(node.host):
                if not (unsettled and node.ticket.kind == "backup"):
                    assert self.holds(self.copies.host, page, prefix, i), "wrong KV on host"
            for i, page in enumerate(node.pages):
                if not (unsettled and node.ticket.kind == "load"):
                    assert self.holds(self.copies.device, page, prefix, i), "wrong KV on device"

    def nodes(self) -> list[HiNode]:
        out, stack = [], [self.cache.tree.root]
        while stack:
            for child in stack.pop().children.values():
                assert isinstance(child, HiNode)
                out.append(child)
                stack.append(child)
        return out

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for req in list(self.live):
            self.finish(req)
        self.copies.run()
        self.cache.reset()
        self.cache.check()
        assert self.cache.pool.num_free == self.cache.pool.num_pages
        assert self.cache.host_pool.num_free == self.cache.host_pool.num_pages


def machine_for(policy: WritePolicy) -> type[TieredMachine]:
    machine = type(f"Tiered_{policy}", (TieredMachine,), {"policy": policy})
    test = machine.TestCase
    test.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
    return test


TestWriteThrough = machine_for("write_through")
TestWriteBack = machine_for("write_back")
TestWriteThroughSelective = machine_for("write_through_selective")
