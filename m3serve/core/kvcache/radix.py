"""Page-granular radix tree over token ids: the prefix cache.

Each node holds a run of whole pages: `len(pages) * page_size` tokens and the physical KV pages
that hold them. Children are keyed by the tuple of their first page's tokens, so one dict lookup
picks the only child that can continue a prefix. Nodes are split at page boundaries when a match
or an insert diverges inside them; a partial page is never stored or matched.

Nodes carry a lock count (requests using the prefix); locked nodes and their ancestors are never
evicted. Unlocked leaves are evicted least recently used first, by a logical clock that ticks
once per `match` / `insert`, so tests are deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from m3serve.core.kvcache.pages import PagePool
from m3serve.runtime.messages import PageCopy

# Page ownership (mini-sglang's `cache_req` comment, for a page-granular tree).
#
# A request's pages are `[matched | own]`:
#   pages[:matched]     the tree's, from `match`; locked while the request runs, so they cannot be
#                       evicted. The request reads them and never frees them.
#   pages[matched:]     the request's, from the pool; they hold the KV it computed.
# When it finishes, aborts or is retracted, with `whole` = full pages of tokens whose KV is written:
#   dup = tree.insert(tokens, pages[:whole])     dup >= matched: the locked match is still there
#   pages[matched:dup]  duplicates: another request cached the same tokens meanwhile; the tree
#                       keeps its own copy, so the request frees these.
#   pages[dup:whole]    now the tree's: insert took them over.
#   pages[whole:]       the partial tail page (and any unused reserved page): freed.
#   then tree.unlock(match.node).
# So at any moment: pool free + tree cached + sum of live requests' own pages == all pages.
# `PrefixCache` below does exactly this and keeps the count that proves it.


class Node:
    """A run of whole pages of tokens in the tree, and the KV pages that hold them."""

    __slots__ = ("children", "key", "last_access", "lock_count", "node_id", "pages", "parent")

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[int],
        parent: Node | None,
        node_id: int,
        last_access: int,
    ) -> None:
        self.key = key  # len(pages) * page_size tokens
        self.pages = pages
        self.parent = parent  # None for the root and for an evicted node
        self.children: dict[tuple[int, ...], Node] = {}  # by the child's first page of tokens
        self.lock_count = 0
        self.last_access = last_access
        self.node_id = node_id  # creation order: breaks LRU ties without comparing nodes

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class Match:
    """The longest cached prefix: its pages, and the deepest node of it (what to lock).

    With a host tier (HiCache), the prefix may go on past `pages` in `host`: nodes whose KV is
    only in host memory, which admission loads back (`PrefixCache.load_back`)."""

    pages: list[int]
    node: Node
    num_tokens: int  # len(pages) * page_size
    host: tuple[Node, ...] = ()


class RadixTree:
    """Token-id prefixes in whole pages → the physical pages holding their KV."""

    node_type: type[Node] = Node

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._ids = itertools.count()
        self._clock = 0
        self._root = self.node_type((), [], None, next(self._ids), self._clock)
        self._evictable = 0  # pages in unlocked nodes
        self._protected = 0  # pages in locked nodes

    # ------------------------------------------------------------------------------ accounting

    @property
    def root(self) -> Node:
        return self._root

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes. All of them can be evicted: a parent's lock count is at least
        its children's, so the subtree below an unlocked node is unlocked too."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    # ------------------------------------------------------------------------------ operations

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest cached prefix of `tokens`, in whole pages; refreshes its LRU time.

        A node the match ends inside is split, so that `Match.node` covers exactly the match.
        The scheduler passes a prompt without its last token: that one is always computed.
        """
        ps = self.page_size
        key = _page_key(tokens, len(tokens) // ps * ps)
        now = self._tick()
        node, pages, pos = self._root, [], 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            child = self._split_at_divergence(child, key, pos)
            child.last_access = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return Match(pages, node, pos)

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` `match` would find, without touching the tree
        (no split, no LRU refresh): what the longest-prefix-first queue order sorts by."""
        ps = self.page_size
        key = _page_key(tokens, len(tokens) // ps * ps)
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            same = self._common_pages(child.key, key, pos)
            pos += same * ps
            if same * ps < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the first `len(pages)` whole pages of `tokens`, held in `pages`.

        Returns how many leading pages were already cached. The caller keeps ownership of those
        passed-in pages (the tree keeps its own copies); the tree owns the rest from now on.
        """
        ps = self.page_size
        if len(tokens) < len(pages) * ps:
            raise ValueError(f"{len(pages)} pages need {len(pages) * ps} tokens, got {len(tokens)}")
        key = _page_key(tokens, len(pages) * ps)
        now = self._tick()
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                self._add_leaf(node, key[pos:], list(pages[pos // ps :]), now)
                return pos // ps
            child = self._split_at_divergence(child, key, pos)
            child.last_access = now
            pos += len(child.key)
            node = child
        return len(pages)

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (one more user of that prefix)."""
        self._check_in_tree(node)
        for step in self._path(node):
            if step.lock_count == 0:
                self._evictable -= len(step.pages)
                self._protected += len(step.pages)
            step.lock_count += 1

    def unlock(self, node: Node) -> None:
        """Undo one `lock(node)`."""
        self._check_in_tree(node)
        if node is not self._root and node.lock_count == 0:
            raise RuntimeError("unlock of a node that is not locked")
        for step in self._path(node):
            step.lock_count -= 1
            if step.lock_count == 0:
                self._protected -= len(step.pages)
                self._evictable += len(step.pages)

    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked leaves, least recently used first, until at least `num_pages` pages are
        released or nothing is evictable. Returns the released pages (for the page pool)."""
        released: list[int] = []
        if num_pages <= 0:
            return released
        # Collecting leaves walks the tree, but only here: match and insert stay bookkeeping-free.
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while heap and len(released) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            released.extend(leaf.pages)
            parent = self._remove_leaf(leaf)
            if parent is not self._root and parent.is_leaf and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return released

    def reset(self) -> list[int]:
        """Empty the tree; returns every cached page (for the page pool). Refuses while a
        request holds a lock, since that request reads pages the tree owns."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked pages")
        released = [page for node in self._walk() for page in node.pages]
        for child in self._root.children.values():
            child.parent = None  # detached, so a stale Match's node fails lock/unlock
        # The root stays: an empty Match (its node is the root) taken before is still valid.
        self._root.children.clear()
        self._evictable = 0
        return released

    def check(self) -> None:
        """Raise AssertionError unless every structural and accounting invariant holds."""
        root = self._root
        assert root.parent is None and not root.key and not root.pages, "root must be empty"
        assert root.lock_count == 0, "the root is never locked"
        held: set[int] = set()
        evictable = protected = 0
        for node in self._walk():
            for first, child in node.children.items():
                self._check_child(node, first, child)
            if node is root:
                continue
            assert held.isdisjoint(node.pages), f"pages held twice: {held & set(node.pages)}"
            held.update(node.pages)
            if node.lock_count:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert len(held) == evictable + protected
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"counted evictable/protected {evictable}/{protected}, "
            f"tracked {self._evictable}/{self._protected}"
        )

    # ------------------------------------------------------------------------------ helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split_at_divergence(self, node: Node, key: tuple[int, ...], pos: int) -> Node:
        """`node` matches `key[pos:]` in its first page (it was found by it); if it stops matching
        before its end, split it there. Returns the node that matches completely."""
        same = self._common_pages(node.key, key, pos)
        return node if same * self.page_size == len(node.key) else self._split(node, same)

    def _common_pages(self, run: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        ps = self.page_size
        limit = min(len(run), len(key) - pos) // ps
        n = 1  # the first page matched already: it is the child's dict key
        while n < limit and run[n * ps : (n + 1) * ps] == key[pos + n * ps : pos + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut `node` after its first `num_pages` pages; returns the new upper part. The lower
        part stays the same object, so a Match (and its lock) on `node` keeps meaning its path."""
        ps, cut = self.page_size, num_pages * self.page_size
        parent = node.parent
        assert parent is not None, "the root is never split"
        head = self.node_type(
            node.key[:cut], node.pages[:num_pages], parent, next(self._ids), node.last_access
        )
        head.lock_count = node.lock_count  # every lock on `node` went through what is now `head`
        parent.children[head.key[:ps]] = head
        node.key = node.key[cut:]
        node.pages = node.pages[num_pages:]
        node.parent = head
        head.children[node.key[:ps]] = node
        return head

    def _add_leaf(self, parent: Node, key: tuple[int, ...], pages: list[int], now: int) -> None:
        leaf = self.node_type(key, pages, parent, next(self._ids), now)
        parent.children[key[: self.page_size]] = leaf
        self._evictable += len(pages)

    def _remove_leaf(self, leaf: Node) -> Node:
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.lock_count == 0
        del parent.children[leaf.key[: self.page_size]]
        leaf.parent = None  # marks it evicted: lock/unlock on it now raise
        self._evictable -= len(leaf.pages)
        return parent

    def _path(self, node: Node) -> Iterator[Node]:
        """`node` and its ancestors, the root left out (it holds no pages and is never locked)."""
        while node.parent is not None:
            yield node
            node = node.parent

    def _walk(self) -> Iterator[Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evictable_leaves(self) -> Iterator[Node]:
        for node in self._walk():
            if node is not self._root and node.is_leaf and node.lock_count == 0:
                yield node

    def _check_in_tree(self, node: Node) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self._root:
            raise ValueError("node is not in this tree (evicted, or from before a reset)")

    def _check_child(self, parent: Node, first: tuple[int, ...], child: Node) -> None:
        ps = self.page_size
        assert child.parent is parent, "child does not point back at its parent"
        assert child.pages, "a non-root node holds at least one page"
        assert len(child.key) == len(child.pages) * ps, "key length != pages * page_size"
        assert first == child.key[:ps], "child keyed by something other than its first page"
        assert child.lock_count >= 0, "negative lock count"
        if parent is not self._root:
            assert parent.lock_count >= child.lock_count, "child locked more than its parent"
            assert parent.last_access >= child.last_access, "child used more recently than parent"


class PrefixCache:
    """The radix tree and the page pool together, following the ownership protocol above.

    `request_pages` counts pages handed out by `alloc` and not yet released, so `check` can prove
    that no page leaked: pool free + tree cached + request pages == all pages.
    With `enabled=False` nothing is cached: matches are empty and release frees everything.
    """

    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True) -> None:
        self.pool = pool
        self.tree = RadixTree(page_size)
        self.enabled = enabled
        self.request_pages = 0

    @property
    def available_pages(self) -> int:
        """Pages `alloc` could hand out now: the free ones plus all evictable cached ones."""
        return self.pool.num_free + self.tree.evictable_pages

    def acquire(self, prompt: Sequence[int]) -> Match:
        """Match and lock the cached prefix of a prompt. Its last token is left out of the match:
        the model must run at least one token to produce the next token's logits."""
        if not self.enabled:
            return Match([], self.tree.root, 0)
        match = self.tree.match(prompt[: len(prompt) - 1])
        self.tree.lock(match.node)
        return match

    def cached_length(self, prompt: Sequence[int]) -> int:
        """The tokens of `prompt` that `acquire` would match now, changing nothing."""
        return self.tree.cached_length(prompt[: len(prompt) - 1]) if self.enabled else 0

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages for a request, evicting cached prefixes when the pool is short; None
        (allocating nothing) when even eviction cannot free enough."""
        pages = self._take(n)
        if pages is not None:
            self.request_pages += n
        return pages

    def free_tail(self, pages: Sequence[int]) -> None:
        """Give back pages a request allocated and no longer needs (the tail past a verify
        step's rejected drafts): never cached, so straight to the pool."""
        self.pool.free(pages)
        self.request_pages -= len(pages)

    def load_back(self, match: Match) -> Match | None:
        """The match with its host part (if any) on the device: pages allocated and a copy
        scheduled; None when the device cannot take it. Without a host tier, `match` itself."""
        return match

    @property
    def has_unsent_loads(self) -> bool:
        """Load-backs that the next step must carry (none without a host tier)."""
        return False

    def take_loads(self) -> list[PageCopy]:
        """The load-backs for the step being planned."""
        return []

    def _take(self, n: int) -> list[int] | None:
        short = n - self.pool.num_free
        if short > 0:
            if short > self.tree.evictable_pages:
                return None  # evicting would lose cache and still not be enough
            self.pool.free(self.tree.evict(short))
        return self.pool.alloc(n)

    def release(self, tokens: Sequence[int], pages: Sequence[int], match: Match) -> None:
        """A request is done with its KV (finished, aborted or retracted).

        `tokens`: the tokens whose KV is written, in order (prompt + output so far, so a later
        turn can hit on the output too); `pages`: the request's pages, `match.pages` first, then
        those from `alloc`. Whole pages are cached, the rest freed, and the match unlocked.
        """
        ps, matched = self.tree.page_size, len(match.pages)
        if list(pages[:matched]) != match.pages:
            raise ValueError("a request's pages must start with the pages of its match")
        if len(tokens) < match.num_tokens:
            raise ValueError("fewer tokens than the match covers: the tree's pages would be freed")
        whole = min(len(tokens) // ps, len(pages)) if self.enabled else 0
        dup = self.tree.insert(tokens, pages[:whole]) if whole else 0
        if dup < matched:
            raise RuntimeError(f"locked match of {matched} pages found only {dup} in the tree")
        self.pool.free([*pages[matched:dup], *pages[whole:]])
        self.tree.unlock(match.node)
        self.request_pages -= len(pages) - matched

    def reset(self) -> None:
        """Drop the whole cache back into the pool (only when no request holds a match)."""
        self.pool.free(self.tree.reset())

    def check(self) -> None:
        """Raise AssertionError unless the pool, the tree and their shared count are consistent."""
        self.pool.check()
        self.tree.check()
        total = self.pool.num_free + self.tree.cached_pages + self.request_pages
        assert total == self.pool.num_pages, (
            f"{self.pool.num_free} free + {self.tree.cached_pages} cached + "
            f"{self.request_pages} in requests != {self.pool.num_pages} pages"
        )


def _page_key(tokens: Sequence[int], length: int) -> tuple[int, ...]:
    """The first `length` tokens as a tuple of Python ints (hashable, cheap to slice)."""
    head = tokens[:length]
    # Token ids travel as numpy arrays; tolist() converts them in C instead of one by one.
    if hasattr(head, "tolist"):
        head = head.tolist()
    return tuple(head)
