"""L3 write-behind: host pages go on to the storage tier once their copy from the device is done.

The tiered prefix cache tells `WriteBehind` of every backup to host (`backed_up`): the pages'
keys are computed then, from the nodes' token prefixes (core/hicache/keys.py), and wait until the
backup's ticket is done; `send` (each scheduling round) hands the finished ones to the host-cache
actor as one `Backup`. From then until its `Done`, the actor reads those host pages, so they are
pinned: the host evictor skips their nodes, and a page the cache lets go of anyway (a device
eviction dropping a host-only subtree, a reset) is parked, back in the pool once the ticket ends.
A page let go of before its write was sent is simply not written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from m3serve.core.hicache.keys import PageKey, page_keys
from m3serve.core.hicache.storage_client import HiCacheUnavailable, StorageClient
from m3serve.core.hicache.tickets import Ticket
from m3serve.core.kvcache.hiradix import HiNode

if TYPE_CHECKING:
    from m3serve.core.hicache.prefix_cache import HiPrefixCache

log = logging.getLogger(__name__)


class WriteBehind:
    """The cache's `HostStorage`: writes to L3 behind the host backups, and the pages they pin."""

    def __init__(self, client: StorageClient, cache: HiPrefixCache, root: PageKey) -> None:
        self.client = client
        self.cache = cache
        self.root = root
        self._unsent: dict[int, tuple[Ticket, PageKey]] = {}  # host page -> its copy, its key
        self._parked: set[int] = set()

    # ------------------------------------------------------------------ HostStorage

    def backed_up(self, ticket: Ticket, nodes: Sequence[HiNode]) -> None:
        memo: dict[int, PageKey] = {}
        keys = [key for node in nodes for key in self._node_keys(node, memo)]
        for host, key in zip(ticket.host, keys, strict=True):
            self._unsent[host] = (ticket, key)

    def pinned(self, host_page: int) -> bool:
        return self.client.busy(host_page)

    def freeing(self, host_pages: list[int]) -> list[int]:
        free = []
        for h in host_pages:
            self._unsent.pop(h, None)  # not written: its page is about to hold something else
            if self.client.busy(h):
                self._parked.add(h)
            else:
                free.append(h)
        return free

    @property
    def parked(self) -> int:
        return len(self._parked)

    # ------------------------------------------------------------------ rounds

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def send(self) -> None:
        """Send the writes whose host copy is done; return parked pages that are free again."""
        ready = [(h, key) for h, (ticket, key) in self._unsent.items() if ticket.done()]
        for h, _ in ready:
            del self._unsent[h]
        if ready:
            try:
                self.client.backup([key for _, key in ready], [h for h, _ in ready])
            except HiCacheUnavailable:
                return  # the tier notices the death on its next round
            except ValueError as exc:  # a page a prefetch fills: a bug, but never a wrong page
                log.error("HiCache: L3 write refused: %s", exc)
        free = [h for h in self._parked if not self.client.busy(h)]
        if free:
            self._parked.difference_update(free)
            self.cache.host_pool.free(free)

    # ------------------------------------------------------------------ keys

    def _node_keys(self, node: HiNode, memo: dict[int, PageKey]) -> list[PageKey]:
        """The keys of a node's pages: the hash chain from the root over its ancestors' tokens.
        `memo` holds the last key of nodes seen in this call, so a path is hashed once."""
        ps = self.cache.tree.page_size
        parent, todo = self.root, []
        for ancestor in self.cache.tree.lineage(node)[1:]:  # deepest first
            if ancestor.node_id in memo:
                parent = memo[ancestor.node_id]
                break
            todo.append(ancestor)
        for ancestor in reversed(todo):
            parent = page_keys(parent, ancestor.key, ps)[-1]
            memo[ancestor.node_id] = parent
        keys = page_keys(parent, node.key, ps)
        memo[node.node_id] = keys[-1]
        return keys
