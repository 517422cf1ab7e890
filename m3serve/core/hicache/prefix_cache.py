"""`HiPrefixCache`: the prefix cache over two tiers, device pages and host pages, deciding what
is copied between them and when.

Write policies (`--hicache-write-policy`):
- write_through: a node is backed up to host as its pages enter the tree (a request's release);
- write_through_selective: a node is backed up once admitted requests hit it twice;
- write_back: a node is backed up only when the device evicts it (the eviction waits for it).
Whatever the policy, evicting a device node that has a host copy keeps it (host-only); one
without is dropped. A match's host-only continuation is loaded back when its request is
admitted (`load_back`): device pages are allocated for it now and the copy rides the next step.

L3 (`storage`, a `HostStorage`, set when the host-cache actor runs): it hears of every backup
to host (to write the pages on to L3 once copied), says which host pages an L3 ticket still
owns (the host evictor skips those nodes) and keeps freed pages that one still owns until it
finishes (`parked`). If the host pool goes away (its process died), `disable_host` drops the
host tier and the cache goes on as a device-only one.

Ownership, which `check()` proves:
  device: pool free + tree device pages + request pages == device pages
  host:   host pool free + tree host pages + reserved (fetches) + parked == host pages
and no page of an unfinished copy is free on either tier. A copy's pages always belong to tree
nodes; a node's pages are freed only after `_settle` waited for its copy, and the pools refuse
(raise) to free a page that a copy still touches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

from m3serve.core.hicache.tickets import CopyTracker, Ticket
from m3serve.core.kvcache.hiradix import HiNode, HiRadixTree
from m3serve.core.kvcache.pages import PagePool
from m3serve.core.kvcache.radix import Match, PrefixCache
from m3serve.runtime.messages import PageCopy

WritePolicy = Literal["write_through", "write_back", "write_through_selective"]
SELECTIVE_HITS = 2  # write_through_selective backs a node up at this many hits


class HostStorage(Protocol):
    """What the cache tells the L3 tier, and asks it, about host pages."""

    def backed_up(self, ticket: Ticket, nodes: Sequence[HiNode]) -> None:
        """`ticket` copies these nodes' device pages to their (new) host pages."""

    def pinned(self, host_page: int) -> bool:
        """Whether an L3 ticket still owns the page (it may be neither freed nor reused)."""

    def freeing(self, host_pages: list[int]) -> list[int]:
        """The cache lets go of these pages: those that may go back to the pool now (the
        others are kept until their L3 ticket finishes)."""

    @property
    def parked(self) -> int:
        """Pages let go of and still kept."""


class GuardedPool(PagePool):
    """A page pool that refuses to free a page an unfinished copy still reads or writes."""

    def __init__(self, num_pages: int, busy: Callable[[], set[int]]) -> None:
        super().__init__(num_pages)
        self._busy = busy

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if pages:
            busy = self._busy().intersection(pages)
            if busy:
                raise RuntimeError(f"freeing pages {sorted(busy)} while a copy uses them")
        super().free(pages)


class HiPrefixCache(PrefixCache):
    def __init__(
        self,
        num_pages: int,
        host_pages: int,
        page_size: int,
        policy: WritePolicy = "write_through",
        copies: CopyTracker | None = None,
    ) -> None:
        self.copies = copies or CopyTracker()
        super().__init__(GuardedPool(num_pages, lambda: self.copies.in_flight()[0]), page_size)
        self.tree: HiRadixTree = HiRadixTree(page_size)
        self.host_pool = GuardedPool(host_pages, lambda: self.copies.in_flight()[1])
        self.policy = policy
        self.loaded_pages = 0  # pages loaded back so far (a metric)
        self.storage: HostStorage | None = None
        self.host_enabled = True  # False once the host pool is gone (disable_host)
        self.reserved_host = 0  # host pages a fetch holds (reserve_host until it ends)

    # ------------------------------------------------------------------ the request protocol

    def load_back(self, match: Match) -> Match | None:
        """Put an admitted request's host-only continuation on the device: device pages for
        it, a load-back ticket the next step carries, and the match extended over it."""
        if match.host:
            pages = self._take(sum(len(node.host) for node in match.host))
            if pages is None:
                return None
            host: list[int] = []
            at = 0
            for node in self._hi(match.host):
                host.extend(node.host)
                self.tree.attach_device(node, pages[at : at + len(node.host)])
                at += len(node.host)
            ticket = self.copies.load(pages, host)
            for node in self._hi(match.host):
                node.ticket = ticket
            self.loaded_pages += len(pages)
            ps = self.tree.page_size
            match = Match([*match.pages, *pages], match.node, match.num_tokens + len(pages) * ps)
        self._count_hit(match)
        return match

    def release(self, tokens: Sequence[int], pages: Sequence[int], match: Match) -> None:
        super().release(tokens, pages, match)
        if self.policy == "write_through":
            whole = min(len(tokens) // self.tree.page_size, len(pages))
            self._backup(self.tree.path(tokens[: whole * self.tree.page_size]))

    # ------------------------------------------------------------------ the L3 seam

    def reserve_host(self, n: int) -> list[int] | None:
        """`n` host pages for a fetch from the L3 tier (evicting host-only prefixes), or None.
        Until `add_host_prefix` or `release_host` they are the fetcher's."""
        host = self._take_host(n)
        if host is not None:
            self.reserved_host += n
        return host

    def add_host_prefix(self, tokens: Sequence[int], host: list[int], start: int = 0) -> int:
        """Fetched pages, written into `host` (from `reserve_host`; `host[i]` holds page
        `start + i` of `tokens`), become host-only KV; pages the tree already had, or that
        can no longer join it, go back to the pool. Returns how many joined."""
        self.reserved_host -= len(host)
        if not self.host_enabled:
            return 0
        kept = self.tree.insert_host(tokens, host, start)
        self._free_host(host[:kept])
        return len(host) - kept

    def release_host(self, host: list[int]) -> None:
        """Give back reserved host pages a fetch did not use (it failed or was cancelled)."""
        self.reserved_host -= len(host)
        if self.host_enabled:
            self._free_host(host)

    def disable_host(self) -> int:
        """The host pool is gone (its process died): drop the host tier, so that no page of it
        is read, written or handed out again; returns how many host pages the tree held. Copies
        already queued for the executor are its business (tier.py)."""
        self.host_enabled = False
        self.storage = None
        return len(self.tree.drop_host_tier())

    @property
    def has_unsent_loads(self) -> bool:
        return self.copies.has_unsent

    def take_loads(self) -> list[PageCopy]:
        self.copies.reap()
        return [PageCopy(t.op, t.device, t.host) for t in self.copies.take_unsent()]

    def reset(self) -> None:
        self.copies.wait_all()
        device, host = self.tree.reset_tiers()
        self.pool.free(device)
        if self.host_enabled:
            self._free_host(host)

    # ------------------------------------------------------------------ policy

    def _count_hit(self, match: Match) -> None:
        chosen = []
        for node in self.tree.lineage(match.node):
            node.hits += 1
            if self.policy == "write_through_selective" and node.hits >= SELECTIVE_HITS:
                chosen.append(node)
        self._backup(chosen)

    def _backup(self, nodes: Iterable[HiNode], wait: bool = False) -> None:
        """Copy the device nodes among `nodes` that have no host copy yet to host (all of them
        or, when the host cannot make room, none)."""
        nodes = [node for node in nodes if node.pages and not node.host]
        if not nodes:
            return
        host = self._take_host(sum(len(node.pages) for node in nodes))
        if host is None:
            return  # the host tier is full of locked or device-resident copies
        device: list[int] = []
        at = 0
        for node in nodes:
            device.extend(node.pages)
            self.tree.attach_host(node, host[at : at + len(node.pages)])
            at += len(node.pages)
        ticket = self.copies.backup(device, host)
        for node in nodes:
            node.ticket = ticket
        if self.storage is not None:
            self.storage.backed_up(ticket, nodes)
        if wait:
            ticket.wait()

    # ------------------------------------------------------------------ eviction

    def _take(self, n: int) -> list[int] | None:
        short = n - self.pool.num_free
        if short > 0:
            if short > self.tree.evictable_pages:
                return None
            self._evict_device(short)
        return self.pool.alloc(n)

    def _evict_device(self, num_pages: int) -> None:
        victims = self.tree.device_victims(num_pages)
        if self.policy == "write_back":
            self._backup(victims, wait=True)
        for node in victims:
            self._settle(node)
            if node.host:
                self.pool.free(self.tree.drop_device(node))
            else:
                self._drop(node)

    def _take_host(self, n: int) -> list[int] | None:
        if not self.host_enabled:
            return None
        short = n - self.host_pool.num_free
        if short > 0:
            victims = self.tree.host_victims(short, self._pinned)
            if sum(len(node.host) for node in victims) < short:
                return None  # evicting would lose host copies and still not be enough
            for node in victims:
                self._drop(node)
        return self.host_pool.alloc(n)

    def _drop(self, node: HiNode) -> None:
        """Take a node and its host-only subtree out of the tree, freeing their pages."""
        for gone in self.tree.remove(node):
            self._settle(gone)
            self.pool.free(gone.pages)
            self._free_host(gone.host)

    def _free_host(self, pages: list[int]) -> None:
        if self.storage is not None and pages:
            pages = self.storage.freeing(pages)
        self.host_pool.free(pages)

    def _pinned(self, node: HiNode) -> bool:
        """An L3 ticket still owns one of the node's host pages: it stays for now."""
        storage = self.storage
        return storage is not None and any(storage.pinned(h) for h in node.host)

    def _settle(self, node: HiNode) -> None:
        """Wait for the copy still touching this node's pages, if any."""
        if node.ticket is not None:
            node.ticket.wait()
            node.ticket = None

    @staticmethod
    def _hi(nodes: Iterable[object]) -> list[HiNode]:
        out = []
        for node in nodes:
            assert isinstance(node, HiNode)
            out.append(node)
        return out

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        super().check()
        self.host_pool.check()
        self._check_host_count()
        device_busy, host_busy = self.copies.in_flight()
        assert not [p for p in device_busy if self.pool.is_free(p)], "a copy's device page is free"
        if self.host_enabled:
            host_free = [p for p in host_busy if self.host_pool.is_free(p)]
            assert not host_free, "a copy's host page is free"

    def _check_host_count(self) -> None:
        host, cached = self.host_pool, self.tree.host_cached_pages
        if not self.host_enabled:
            assert cached == 0, "host pages in the tree after the host tier was dropped"
            return
        held = self.reserved_host + (self.storage.parked if self.storage is not None else 0)
        assert host.num_free + cached + held == host.num_pages, (
            f"{host.num_free} host free + {cached} host cached + {held} reserved or parked "
            f"!= {host.num_pages} host pages"
        )
