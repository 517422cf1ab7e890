"""The engine's side of the host-cache actor: the host pool it owns, the L3 tier behind it, and
what happens when its process dies.

`ActorLink.open_pool` is how the engine core, starting on a worker thread, gets the host pool:
it asks the actor (`StorageClient.open`, on the engine's event loop) and attaches the segment
the actor made. `StorageTier` then runs on the event loop with the scheduler: each scheduling
round (`poll`) settles finished L3 prefetches (prefetch.py) and sends L3 writes behind finished
host backups (write_behind.py), both only with `--hicache-storage-backend`.

Death of the actor (the client is no longer alive): the requests still waiting on a prefetch
fail with `DIED_WHILE_FETCHING`, no backup or prefetch is sent again, and, since the host pool
was the actor's, the host tier goes too: host-only prefixes leave the tree, device prefixes
forget their host copies, and no new copy to or from the segment is made (`on_disabled` stops
the executor's queued backups). Copies already handed to a step still run: the engine's own
mapping of the segment stays valid until it closes it, whoever unlinked the name. The engine
goes on serving from its device cache, which the log says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from m3serve.core.hicache.host_pool import HostKVPool, PageLayout
from m3serve.core.hicache.keys import PageKey, checkpoint_identity, root_key
from m3serve.core.hicache.prefetch import Prefetcher
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.storage_client import HiCacheUnavailable, StorageClient
from m3serve.core.hicache.write_behind import WriteBehind
from m3serve.core.req import Req

log = logging.getLogger(__name__)

DIED_WHILE_FETCHING = (
    "the host-cache process died while this request's prefix was being fetched from HiCache "
    "storage; HiCache is disabled (sending the request again computes it)"
)


def page_key_root(model_dir: Path, layout: PageLayout, draft_dir: Path | None = None) -> PageKey:
    """The root of the L3 page keys: the checkpoint, page size, KV dtype and page layout, so
    that another model, dtype or layout never reads these pages; and the speculative draft
    (`draft_dir`, its checkpoint) whose KV the pages carry, so that a replica without a draft,
    or with another one, never takes these pages' draft KV for its own (nor its pages for
    these)."""
    dtype = str(layout.tensors[0].dtype).removeprefix("torch.")
    model = checkpoint_identity(model_dir)
    if draft_dir is not None:
        model += f"+draft:{checkpoint_identity(draft_dir)}"
    return root_key(model, layout.page_size, dtype, layout.describe())


@dataclass(frozen=True)
class ActorLink:
    """The engine core's way to the host-cache actor: its client and the loop it runs on."""

    client: StorageClient
    loop: asyncio.AbstractEventLoop
    timeout_s: float  # for the actor's answer to the host-pool request

    def open_pool(self, layout: PageLayout, num_pages: int, ranks: int = 1) -> HostKVPool:
        """Have the actor make the host pool (one per rank of a tensor-parallel engine) and
        attach it (rank 0's). Called off the event loop (the engine core is built on a worker
        thread), which it blocks on for the answer."""
        opening = self.client.open(layout.page_bytes, num_pages, self.timeout_s, ranks)
        future = asyncio.run_coroutine_threadsafe(opening, self.loop)
        try:
            ready = future.result(self.timeout_s + 5.0)
        except HiCacheUnavailable as exc:
            why = self.client.why or str(exc)
            message = f"HiCache: the host-cache actor opened no host pool: {why}"
            raise RuntimeError(message) from exc
        return HostKVPool.attach(ready.segment, layout, num_pages)


class StorageTier:
    """L3 write-behind and prefetch (with a storage backend, `root` set) and the actor's life."""

    def __init__(
        self,
        client: StorageClient,
        cache: HiPrefixCache,
        root: PageKey | None,
        on_disabled: Callable[[], None],
    ) -> None:
        self.client = client
        self.cache = cache
        self.on_disabled = on_disabled
        self.disabled = False
        self.writes = WriteBehind(client, cache, root) if root is not None else None
        self.fetches = Prefetcher(client, cache, root) if root is not None else None
        cache.storage = self.writes

    @property
    def hit_tokens(self) -> int:
        """Tokens fetched from L3 into the tree so far."""
        return self.fetches.hit_tokens if self.fetches is not None else 0

    @property
    def has_work(self) -> bool:
        """L3 writes that wait for their host copy: the next rounds send them."""
        return not self.disabled and self.writes is not None and self.writes.has_unsent

    def fetch_prefix(self, req: Req) -> None:
        """A request was queued: fetch from L3 the prefix pages neither tier holds."""
        if self.fetches is not None and not self.disabled and self.client.alive:
            self.fetches.start(req)

    def poll(self) -> list[tuple[Req, str]]:
        """One scheduling round; returns the requests to fail, and why."""
        if self.disabled:
            return []
        if not self.client.alive:
            return self._disable()
        if self.fetches is not None:
            self.fetches.settle()
        if self.writes is not None:
            self.writes.send()
        return []

    def _disable(self) -> list[tuple[Req, str]]:
        self.disabled = True
        failed = self.fetches.waiting() if self.fetches is not None else []
        if self.fetches is not None:
            self.fetches.forget()
        self.on_disabled()
        dropped = self.cache.disable_host()
        log.error(
            "HiCache disabled: the host-cache process is gone; %d host pages dropped, %d "
            "requests waiting on an L3 fetch failed; serving from the device cache only",
            dropped,
            len(failed),
        )
        return [(req, DIED_WHILE_FETCHING) for req in failed]
