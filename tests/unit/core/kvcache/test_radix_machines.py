"""RadixTree and PrefixCache (m3serve.core.kvcache.radix) under random workloads: two state
machines drive the bare tree against a model (a dict of cached page-aligned prefixes), and whole
requests through a PrefixCache over a small PagePool, with simulated KV contents so that a page
freed or reused too early shows up as wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from m3serve.core.kvcache.pages import PagePool
from m3serve.core.kvcache.radix import Match, Node, PrefixCache, RadixTree

Prefix = tuple[int, ...]


# ------------------------------------------------------------------------------ random: tree

TOKENS = st.lists(st.integers(0, 1), max_size=10)  # two token values: prefixes collide a lot


class RadixMachine(RuleBasedStateMachine):
    """The tree against a model: `cached` maps each cached page-aligned prefix to the page that
    holds its last page; `access` to the logical time it was last matched or inserted."""

    @initialize(page_size=st.integers(1, 3))
    def start(self, page_size: int) -> None:
        self.ps = page_size
        self.tree = RadixTree(page_size)
        self.clock = 0
        self.cached: dict[Prefix, int] = {}
        self.access: dict[Prefix, int] = {}
        self.locks: list[tuple[Node, Prefix]] = []
        self.given: set[int] = set()  # every page ever passed to insert ...
        self.returned: set[int] = set()  # ... is cached, handed back as a duplicate,
        self.released: set[int] = set()  # ... or released by evict / reset

    def prefixes(self, tokens: list[int], num_pages: int) -> list[Prefix]:
        return [tuple(tokens[: j * self.ps]) for j in range(1, num_pages + 1)]

    def cached_run(self, tokens: list[int]) -> list[Prefix]:
        run = []
        for prefix in self.prefixes(tokens, len(tokens) // self.ps):
            if prefix not in self.cached:
                break
            run.append(prefix)
        return run

    def protected(self) -> set[Prefix]:
        return {p for _, key in self.locks for p in self.prefixes(list(key), len(key) // self.ps)}

    def is_leaf(self, prefix: Prefix) -> bool:
        return not any(
            len(p) == len(prefix) + self.ps and p[: len(prefix)] == prefix for p in self.cached
        )

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        match = self.tree.match(tokens)
        self.clock += 1
        expected = self.cached_run(tokens)
        assert match.pages == [self.cached[p] for p in expected]
        assert match.num_tokens == len(expected) * self.ps
        for prefix in expected:
            self.access[prefix] = self.clock
        if lock:
            self.tree.lock(match.node)
            self.locks.append((match.node, tuple(tokens[: match.num_tokens])))

    @rule(tokens=TOKENS)
    def cached_length(self, tokens: list[int]) -> None:
        # What match would find, without a split or an LRU refresh.
        nodes = sum(1 for _ in self.tree._walk())
        assert self.tree.cached_length(tokens) == len(self.cached_run(tokens)) * self.ps
        assert sum(1 for _ in self.tree._walk()) == nodes

    @rule(tokens=TOKENS, data=st.data())
    def insert(self, tokens: list[int], data: st.DataObject) -> None:
        num_pages = data.draw(st.integers(0, len(tokens) // self.ps), label="num_pages")
        pages = [len(self.given) + i for i in range(num_pages)]  # fresh ids, never reused
        self.given.update(pages)
        dup = self.tree.insert(tokens, pages)
        self.clock += 1
        assert dup == len(self.cached_run(tokens[: num_pages * self.ps]))
        for j, prefix in enumerate(self.prefixes(tokens, num_pages)):
            self.cached.setdefault(prefix, pages[j])
            self.access[prefix] = self.clock
        self.returned.update(pages[:dup])

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1), label="lock"))
        self.tree.unlock(node)

    @rule(num_pages=st.integers(0, 6))
    def evict(self, num_pages: int) -> None:
        protected = self.protected()
        released = self.tree.evict(num_pages)
        owner = {page: prefix for prefix, page in self.cached.items()}
        gone = [owner[page] for page in released]  # KeyError: released a page it did not hold
        assert len(set(gone)) == len(gone)
        assert protected.isdisjoint(gone), "evicted a locked path"
        assert len(released) >= num_pages or self.tree.evictable_pages == 0
        assert num_pages > 0 or released == []
        times = [self.access[p] for p in gone]
        assert times == sorted(times), "evicted out of LRU order"
        for prefix in gone:
            del self.cached[prefix]
        survivors = [p for p in self.cached if p not in protected and self.is_leaf(p)]
        if gone and survivors:
            assert max(times) <= min(self.access[p] for p in survivors), "a newer leaf went first"
        for prefix in gone:
            del self.access[prefix]
        self.released.update(released)

    @rule()
    def reset(self) -> None:
        if self.protected():  # locks of empty matches (on the root) protect nothing
            with pytest.raises(RuntimeError):
                self.tree.reset()
            return
        released = self.tree.reset()
        assert sorted(released) == sorted(self.cached.values())
        self.released.update(released)
        self.cached.clear()
        self.access.clear()

    @invariant()
    def tree_matches_model(self) -> None:
        self.tree.check()
        assert self.contents() == (self.cached, self.access)
        protected = self.protected()
        assert protected <= self.cached.keys()
        assert self.tree.cached_pages == len(self.cached)
        assert self.tree.protected_pages == len(protected)
        assert self.tree.evictable_pages == len(self.cached) - len(protected)
        kept = set(self.cached.values())
        assert self.given == kept | self.returned | self.released
        assert len(self.given) == len(kept) + len(self.returned) + len(self.released)

    def contents(self) -> tuple[dict[Prefix, int], dict[Prefix, int]]:
        """The tree read back as the model's two dicts."""
        pages: dict[Prefix, int] = {}
        access: dict[Prefix, int] = {}
        stack: list[tuple[Prefix, Node]] = [((), self.tree.root)]
        while stack:
            above, node = stack.pop()
            for child in node.children.values():
                for j, page in enumerate(child.pages):
                    prefix = above + child.key[: (j + 1) * self.ps]
                    pages[prefix] = page
                    access[prefix] = child.last_access
                stack.append((above + child.key, child))
        return pages, access


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------------------ random: serving


@dataclass
class Request:
    tokens: list[int]  # tokens whose KV is written
    pages: list[int]  # match.pages, then pages from alloc
    match: Match


class ServingMachine(RuleBasedStateMachine):
    """Requests admitted, decoded, finished, aborted and retracted through a PrefixCache over a
    pool small enough to force eviction and failed allocations. `kv` records which tokens each
    page holds, as the executor would write them: a page freed or reused while still in use
    turns into a wrong match or a wrong tree page."""

    @initialize(page_size=st.integers(1, 3), num_pages=st.integers(0, 12), enabled=st.booleans())
    def start(self, page_size: int, num_pages: int, enabled: bool) -> None:
        self.ps = page_size
        self.pool = PagePool(num_pages)
        self.cache = PrefixCache(self.pool, page_size, enabled=enabled)
        self.kv: dict[int, Prefix] = {}
        self.live: list[Request] = []

    def page_tokens(self, tokens: list[int], i: int) -> Prefix:
        return tuple(tokens[i * self.ps : (i + 1) * self.ps])

    def write_kv(self, req: Request) -> None:
        for i in range(len(req.match.pages), len(req.pages)):
            self.kv[req.pages[i]] = self.page_tokens(req.tokens, i)

    def release(self, req: Request, num_tokens: int) -> None:
        self.cache.release(req.tokens[:num_tokens], req.pages, req.match)
        self.live.remove(req)

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=8))
    def admit(self, prompt: list[int]) -> None:
        match = self.cache.acquire(prompt)
        assert match.num_tokens < len(prompt)
        for i, page in enumerate(match.pages):
            assert self.kv[page] == self.page_tokens(prompt, i), "matched KV of other tokens"
        need = -(-len(prompt) // self.ps) - len(match.pages)
        pages = self.cache.alloc(need)
        if pages is None:  # no room: hand the match back, as the scheduler would
            self.cache.release(prompt[: match.num_tokens], match.pages, match)
            return
        req = Request(list(prompt), [*match.pages, *pages], match)
        self.write_kv(req)
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1), label="request")]
        if len(req.tokens) == len(req.pages) * self.ps:
            pages = self.cache.alloc(1)
            if pages is None:  # decode pressure: retract, keeping its KV in the tree
                self.release(req, len(req.tokens))
                return
            req.pages.extend(pages)
        req.tokens.append(token)
        self.write_kv(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1), label="request")]
        # An abort mid-prefill has KV for fewer tokens (never fewer than the match).
        computed = data.draw(st.integers(req.match.num_tokens, len(req.tokens)), label="computed")
        self.release(req, computed)

    @rule()
    def drain(self) -> None:
        """Everything finishes and the cache is flushed: the pool is whole again."""
        for req in list(self.live):
            self.release(req, len(req.tokens))
        self.cache.reset()
        assert self.pool.num_free == self.pool.num_pages
        self.cache.check()

    @invariant()
    def every_page_accounted_for(self) -> None:
        self.cache.check()
        own = [page for req in self.live for page in req.pages[len(req.match.pages) :]]
        tree_pages = self.tree_pages()
        assert len(set(own)) == len(own) and set(own).isdisjoint(tree_pages)
        assert self.cache.request_pages == len(own)
        assert self.pool.num_free + len(tree_pages) + len(own) == self.pool.num_pages

    def tree_pages(self) -> set[int]:
        """Every page in the tree, checking that it holds the KV of exactly its tokens."""
        pages: set[int] = set()
        stack = [self.cache.tree.root]
        while stack:
            node = stack.pop()
            for i, page in enumerate(node.pages):
                assert self.kv[page] == tuple(node.key[i * self.ps : (i + 1) * self.ps])
                pages.add(page)
            stack.extend(node.children.values())
        return pages

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.drain()


TestServingMachine = ServingMachine.TestCase
TestServingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
