"""The prefix tree with a host tier (HiCache): each node's pages live on the device, in host
memory, or both.

A `HiNode` has `pages` (device pages, possibly none) and `host` (host pages, possibly none),
each either empty or one page per page of its key, never both empty. Two shape rules keep
eviction simple and are checked by `check()`:
- device residency is prefix-closed: a node on the device has its parent on the device, so a
  match is a device run followed by a host-only run, and evicting device leaves never strands
  a device node below a host-only one;
- a host-only node has only host-only children.

Device eviction takes unlocked device leaves (nodes whose children are all host-only) LRU
first: a node with a host copy keeps it and becomes host-only; one without is removed, with its
host-only subtree. Host eviction takes unlocked host-only leaves LRU first. Locks, LRU times and
splits are the base tree's; the base `_evictable` / `_protected` counts stay device pages.
What to copy when is the tiered cache's decision (`core/hicache/prefix_cache.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from m3serve.core.kvcache.radix import Match, Node, RadixTree, _page_key

if TYPE_CHECKING:
    from m3serve.core.hicache.tickets import Ticket


class HiNode(Node):
    __slots__ = ("hits", "host", "ticket")

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[int],
        parent: Node | None,
        node_id: int,
        last_access: int,
    ) -> None:
        super().__init__(key, pages, parent, node_id, last_access)
        self.host: list[int] = []
        self.hits = 0  # matches that used this node (write_through_selective backs up at 2)
        self.ticket: Ticket | None = None  # the copy still touching its pages, if any

    @property
    def num_pages(self) -> int:
        return len(self.pages) or len(self.host)


class HiRadixTree(RadixTree):
    node_type = HiNode

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._host_cached = 0  # host pages held by nodes

    @property
    def host_cached_pages(self) -> int:
        return self._host_cached

    # ------------------------------------------------------------------ match and insert

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest cached prefix: its device pages, then the host-only nodes after them."""
        ps = self.page_size
        key = _page_key(tokens, len(tokens) // ps * ps)
        now = self._tick()
        node, pages, pos, device_pos = self.root, [], 0, 0
        host: list[Node] = []
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            child = self._split_at_divergence(child, key, pos)
            child.last_access = now
            pos += len(child.key)
            if child.pages:
                pages.extend(child.pages)
                device_pos = pos
            else:
                host.append(child)
            node = child
        return Match(pages, node, device_pos, tuple(host))

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """As the base tree's, and a host-only node on the way takes the caller's pages for its
        device copy (the caller computed that KV again). Returns the leading pages that were
        already on the device: the caller still owns those, the tree owns the rest."""
        ps = self.page_size
        if len(tokens) < len(pages) * ps:
            raise ValueError(f"{len(pages)} pages need {len(pages) * ps} tokens, got {len(tokens)}")
        key = _page_key(tokens, len(pages) * ps)
        now = self._tick()
        node, pos, on_device = self.root, 0, None
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                self._add_leaf(node, key[pos:], list(pages[pos // ps :]), now)
                return pos // ps if on_device is None else on_device
            child = self._split_at_divergence(child, key, pos)
            child.last_access = now
            if not child.pages:
                on_device = pos // ps if on_device is None else on_device
                self.attach_device(child, list(pages[pos // ps : pos // ps + len(child.host)]))
            pos += len(child.key)
            node = child
        return len(pages) if on_device is None else on_device

    def insert_host(self, tokens: Sequence[int], host: Sequence[int], start: int = 0) -> int:
        """Cache pages [start, start + len(host)) of `tokens` as host-only KV, fetched from the
        L3 tier into these host pages (`host[i]` holds page `start + i`). They join only after
        a cached prefix of `start` pages (on either tier): the tree holds prefixes, never a run
        with a gap before it. Returns how many leading entries of `host` the caller keeps
        (pages cached meanwhile; all of them when the prefix before `start` is gone); the tree
        owns the rest."""
        ps = self.page_size
        end = start + len(host)
        key = _page_key(tokens, end * ps)
        if len(key) < end * ps:
            raise ValueError(f"pages up to {end} need {end * ps} tokens, got {len(key)}")
        now = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                at = pos // ps
                if at < start:
                    return len(host)  # the prefix before the fetched pages was evicted
                leaf = self.node_type(key[pos:], [], node, next(self._ids), now)
                assert isinstance(leaf, HiNode)
                leaf.host = list(host[at - start :])
                node.children[key[pos : pos + ps]] = leaf
                self._host_cached += len(leaf.host)
                return at - start
            child = self._split_at_divergence(child, key, pos)
            child.last_access = now
            pos += len(child.key)
            node = child
        return len(host)

    def path(self, tokens: Sequence[int]) -> list[HiNode]:
        """The nodes that `tokens` covers completely, root first; changes nothing."""
        ps = self.page_size
        key = _page_key(tokens, len(tokens) // ps * ps)
        node, pos, nodes = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None or key[pos : pos + len(child.key)] != child.key:
                break
            nodes.append(child)
            pos += len(child.key)
            node = child
        return nodes

    def lineage(self, node: Node) -> list[HiNode]:
        """`node` and its ancestors, root excluded, deepest first."""
        return [n for n in self._path(node) if isinstance(n, HiNode)]

    # ------------------------------------------------------------------ tiers of a node

    def attach_device(self, node: HiNode, pages: list[int]) -> None:
        """Device pages for a host-only node (load-back, or a request that recomputed it)."""
        assert not node.pages and len(pages) == len(node.host), "attach to a host-only node"
        assert node.parent is self.root or node.parent.pages, "its parent must be on the device"
        node.pages = pages
        if node.lock_count:
            self._protected += len(pages)
        else:
            self._evictable += len(pages)

    def attach_host(self, node: HiNode, host: list[int]) -> None:
        """Host pages for a device node's backup."""
        assert node.pages and not node.host and len(host) == len(node.pages)
        node.host = host
        self._host_cached += len(host)

    def drop_device(self, node: HiNode) -> list[int]:
        """Evict a backed-up device leaf from the device; it stays as host-only."""
        assert node.host and node.lock_count == 0 and self._is_device_leaf(node)
        pages, node.pages = node.pages, []
        self._evictable -= len(pages)
        return pages

    def remove(self, node: HiNode) -> list[HiNode]:
        """Take an unlocked device leaf or host-only leaf out of the tree with its host-only
        subtree; returns the removed nodes (their pages are the caller's to free)."""
        assert node.lock_count == 0 and node.parent is not None
        assert self._is_device_leaf(node) or not node.pages
        gone = list(self._subtree(node))
        del node.parent.children[node.key[: self.page_size]]
        for each in gone:
            if each.lock_count:
                raise RuntimeError("removing a locked node")
            self._evictable -= len(each.pages)
            self._host_cached -= len(each.host)
            each.parent = None  # evicted: lock/unlock on it now raise
        return gone

    # ------------------------------------------------------------------ eviction order

    def device_victims(self, num_pages: int) -> list[HiNode]:
        """Unlocked device leaves, LRU first (a parent once its device children are all
        picked), until they hold `num_pages` device pages or none is left. Changes nothing."""
        return self._victims(num_pages, self._is_device_leaf, lambda n: len(n.pages))

    def host_victims(
        self, num_pages: int, skip: Callable[[HiNode], bool] | None = None
    ) -> list[HiNode]:
        """Unlocked host-only leaves, LRU first, until they hold `num_pages` host pages; `skip`
        names nodes that may not go now (an L3 write still reads their pages), which keeps
        their ancestors too."""
        return self._victims(num_pages, self._is_host_leaf, lambda n: len(n.host), skip)

    def _victims(
        self,
        num_pages: int,
        is_leaf: Callable[[HiNode, set[int]], bool],
        size: Callable[[HiNode], int],
        skip: Callable[[HiNode], bool] | None = None,
    ) -> list[HiNode]:
        picked: list[HiNode] = []
        if num_pages <= 0:
            return picked
        chosen: set[int] = set()

        def candidate(node: HiNode) -> bool:
            if node is self.root or node.lock_count or not is_leaf(node, chosen):
                return False
            return skip is None or not skip(node)

        heap = [(n.last_access, n.node_id, n) for n in self._hi_nodes() if candidate(n)]
        heapq.heapify(heap)
        count = 0
        while heap and count < num_pages:
            _, _, node = heapq.heappop(heap)
            picked.append(node)
            chosen.add(node.node_id)
            count += size(node)
            parent = node.parent
            if isinstance(parent, HiNode) and candidate(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return picked

    def _is_device_leaf(self, node: HiNode, gone: set[int] | frozenset[int] = frozenset()) -> bool:
        return bool(node.pages) and not any(
            c.pages and c.node_id not in gone for c in node.children.values()
        )

    def _is_host_leaf(self, node: HiNode, gone: set[int] | frozenset[int] = frozenset()) -> bool:
        return not node.pages and all(c.node_id in gone for c in node.children.values())

    # ------------------------------------------------------------------ structure

    def evict(self, num_pages: int) -> list[int]:
        raise TypeError("a tiered tree is evicted through HiPrefixCache (it decides backups)")

    def reset(self) -> list[int]:
        raise TypeError("a tiered tree holds host pages too: use reset_tiers")

    def drop_host_tier(self) -> list[int]:
        """Forget the host tier (its pool is gone): host-only nodes leave the tree, device nodes
        keep only their device pages. Returns every host page the tree held. Host-only nodes are
        never locked between scheduler calls (admission loads them back or lets go at once)."""
        host: list[int] = []
        for node in list(self._hi_nodes()):
            if node.parent is None:
                continue  # removed just now with a host-only ancestor
            if node.pages:
                host.extend(node.host)
                self._host_cached -= len(node.host)
                node.host = []
            else:  # prefix-closed residency: its whole subtree is host-only
                host.extend(page for gone in self.remove(node) for page in gone.host)
        assert self._host_cached == 0, f"{self._host_cached} host pages left after the drop"
        return host

    def reset_tiers(self) -> tuple[list[int], list[int]]:
        """Empty the tree; returns every device page and every host page it held."""
        host = [page for node in self._hi_nodes() for page in node.host]
        device = super().reset()
        self._host_cached = 0
        return device, host

    def _split(self, node: Node, num_pages: int) -> Node:
        assert isinstance(node, HiNode)
        host = node.host
        head = super()._split(node, num_pages)
        assert isinstance(head, HiNode)
        head.host, node.host = host[:num_pages], host[num_pages:]
        head.hits, head.ticket = node.hits, node.ticket
        return head

    def _hi_nodes(self) -> Iterator[HiNode]:
        for node in self._walk():
            if node is not self.root:
                assert isinstance(node, HiNode)
                yield node

    def _subtree(self, node: HiNode) -> Iterator[HiNode]:
        stack = [node]
        while stack:
            top = stack.pop()
            yield top
            stack.extend(c for c in top.children.values() if isinstance(c, HiNode))

    def check(self) -> None:
        super().check()
        host: set[int] = set()
        for node in self._hi_nodes():
            assert host.isdisjoint(node.host), f"host pages held twice: {host & set(node.host)}"
            host.update(node.host)
        counted = self._host_cached
        assert len(host) == counted, f"{len(host)} host pages in nodes, {counted} counted"

    def _check_child(self, parent: Node, first: tuple[int, ...], child: Node) -> None:
        ps = self.page_size
        assert isinstance(child, HiNode) and child.parent is parent
        n = len(child.key) // ps
        assert len(child.key) == n * ps and n > 0, "a node holds whole pages"
        assert len(child.pages) in (0, n) and len(child.host) in (0, n), "partial residency"
        assert child.pages or child.host, "a node lives on some tier"
        assert first == child.key[:ps], "child keyed by something other than its first page"
        assert child.lock_count >= 0, "negative lock count"
        if child.pages:
            assert parent is self.root or parent.pages, "a device node under a host-only one"
        if parent is not self.root:
            assert parent.lock_count >= child.lock_count, "child locked more than its parent"
            assert parent.last_access >= child.last_access, "child used more recently than parent"
