"""L3 prefetch: when a new request's prefix misses the device and host tiers beyond some page,
ask the storage tier for the pages after it before the request is admitted.

`Prefetcher.start` (as the request is queued) reserves host pages for the missing full pages of
its prompt, sends a `Prefetch` and sets `Req.fetch`, so that admission passes over the request
(and takes the ones behind it) until the fetch is settled. `settle` (each scheduling round) puts
the leading pages L3 had into the tree as host-only KV (`add_host_prefix`) and gives the rest
back; admission then loads them back like any host hit. A request waits at most `deadline`
(`fetch_timeout_s`): past it, it is admitted and computes what it misses, while the late fetch
still lands in the tree when it ends. Requests whose prompts share the first missing page share
one fetch. A fetch the actor never answers keeps its host pages until the actor is known dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from m3serve.core.hicache.keys import PageKey, page_keys
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.storage_client import HiCacheUnavailable, StorageClient
from m3serve.core.kvcache.hiradix import HiNode
from m3serve.core.req import Phase, Req

log = logging.getLogger(__name__)

# How long a request may wait for its prefix: a base, and more for long prefixes (SGLang's
# prefetch timeout has the same shape: 1 s + 0.25 s per 1024 tokens; our base leaves room for
# a busy CPU host).
FETCH_TIMEOUT_S = 5.0
FETCH_S_PER_1K_TOKENS = 0.25
MIN_FETCH_PAGES = 1  # a fetch of fewer missing pages is not worth a round trip


def fetch_timeout_s(num_tokens: int) -> float:
    return FETCH_TIMEOUT_S + FETCH_S_PER_1K_TOKENS * num_tokens / 1024


@dataclass(eq=False)
class Fetch:
    """Pages [start, start + len(host)) of `tokens`, being read from L3 into `host`; the
    `Req.fetch` of the requests waiting on it."""

    future: asyncio.Future[int]
    tokens: list[int]
    start: int
    host: list[int]
    deadline: float  # time.monotonic()
    reqs: list[Req] = field(default_factory=list)
    settled: bool = False  # its pages are in the tree (or given back)

    @property
    def expired(self) -> bool:
        return not self.settled and time.monotonic() >= self.deadline

    def done(self) -> bool:
        return self.settled or self.expired

    def wait(self) -> None:
        raise RuntimeError("admission never waits on a fetch")

    def waiting(self) -> list[Req]:
        """The requests still held back by this fetch."""
        if self.done():
            return []
        return [r for r in self.reqs if r.fetch is self and r.phase is Phase.WAITING]


class Prefetcher:
    def __init__(self, client: StorageClient, cache: HiPrefixCache, root: PageKey) -> None:
        self.client = client
        self.cache = cache
        self.root = root
        self.pending: list[Fetch] = []
        self._by_first_key: dict[PageKey, Fetch] = {}
        self.hit_tokens = 0  # tokens that joined the tree from L3 (a metric)

    def start(self, req: Req) -> None:
        """Fetch the full pages of the request's prompt that neither tier holds, if any."""
        ps = self.cache.tree.page_size
        tokens = req.key_prompt[:-1]  # what admission matches: the last token is always computed
        end = len(tokens) // ps
        start = self._cached_pages(tokens)
        if end - start < MIN_FETCH_PAGES:
            return
        # The chain hashes the whole prefix: a page's key names everything before it.
        keys = page_keys(self.root, tokens[: end * ps], ps)[start:]
        same = self._by_first_key.get(keys[0])
        if same is not None and not same.done():
            self._hold(req, same)
            return
        host = self.cache.reserve_host(len(keys))
        if host is None:
            return  # the host pool is full of pinned or locked pages: compute it
        try:
            future = self.client.prefetch(keys, host)
        except (HiCacheUnavailable, ValueError) as exc:
            self.cache.release_host(host)
            if isinstance(exc, ValueError):
                log.error("HiCache: L3 prefetch refused: %s", exc)
            return
        deadline = time.monotonic() + fetch_timeout_s(len(tokens))
        fetch = Fetch(future, tokens[: end * ps], start, host, deadline)
        self.pending.append(fetch)
        self._by_first_key[keys[0]] = fetch
        self._hold(req, fetch)

    def settle(self) -> None:
        """Put what finished fetches found into the tree; give back the rest of their pages."""
        ps = self.cache.tree.page_size
        for fetch in [f for f in self.pending if f.future.done()]:
            self.pending.remove(fetch)
            key_map = self._by_first_key
            for key in [k for k, f in key_map.items() if f is fetch]:
                del key_map[key]
            found = _found(fetch)
            joined = self.cache.add_host_prefix(fetch.tokens, fetch.host[:found], fetch.start)
            self.cache.release_host(fetch.host[found:])
            self.hit_tokens += joined * ps
            fetch.settled = True

    def waiting(self) -> list[Req]:
        """Every request still held back by a fetch."""
        return [req for fetch in self.pending for req in fetch.waiting()]

    def forget(self) -> None:
        """The host pool is gone: the fetches' pages with it."""
        self.pending.clear()
        self._by_first_key.clear()

    def _cached_pages(self, tokens: list[int]) -> int:
        """Leading pages of `tokens` on either tier. The match marks them used, so that the
        host pages reserved next evict other prefixes first, not the one the fetch extends."""
        match = self.cache.tree.match(tokens)
        return len(match.pages) + sum(n.num_pages for n in match.host if isinstance(n, HiNode))

    @staticmethod
    def _hold(req: Req, fetch: Fetch) -> None:
        req.fetch = fetch
        fetch.reqs.append(req)


def _found(fetch: Fetch) -> int:
    """How many leading pages the fetch brought (0 if it failed)."""
    future = fetch.future
    if future.cancelled():
        return 0
    exc = future.exception()
    if exc is not None:
        log.warning("HiCache: an L3 prefetch failed: %s", exc)
        return 0
    return max(0, min(future.result(), len(fetch.host)))
