"""RadixTree and PrefixCache (m3serve.core.kvcache.radix), crafted cases: page granularity, node
splits, LRU order, locks and the ownership protocol.

Random workloads driven by state machines: test_radix_machines.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from m3serve.core.kvcache.pages import PagePool
from m3serve.core.kvcache.radix import Match, PrefixCache, RadixTree


def seq(*pages: int) -> list[int]:
    """Tokens of whole 2-token pages, each named by one number: seq(1, 2) == [10, 11, 20, 21]."""
    return [token for page in pages for token in (10 * page, 10 * page + 1)]


def tree_with(*inserts: tuple[list[int], list[int]]) -> RadixTree:
    tree = RadixTree(page_size=2)
    for tokens, pages in inserts:
        tree.insert(tokens, pages)
        tree.check()
    return tree


# ------------------------------------------------------------------------------ crafted: tree


def test_only_whole_pages_are_matched() -> None:
    tree = tree_with((seq(1, 2), [100, 101]))
    assert tree.match([10]).pages == []
    assert tree.match([10, 11, 20]).pages == [100]
    match = tree.match([*seq(1, 2), 30])
    assert (match.pages, match.num_tokens) == ([100, 101], 4)
    assert tree.match([10, 12, 20, 21]).pages == []


def test_insert_stores_only_the_pages_passed() -> None:
    tree = RadixTree(page_size=2)
    assert tree.insert([*seq(1, 2), 30], [7]) == 0  # one page: tokens past it are ignored
    assert tree.match(seq(1, 2)).pages == [7]
    assert tree.cached_pages == 1
    with pytest.raises(ValueError, match="need 6 tokens"):
        tree.insert(seq(1, 2), [1, 2, 3])


def test_insert_counts_leading_duplicates_and_shared_prefixes_share_pages() -> None:
    tree = tree_with((seq(1, 2, 3), [100, 101, 102]))
    assert tree.insert(seq(1, 2, 4, 5), [200, 201, 202, 203]) == 2
    assert tree.insert(seq(1, 2), [300, 301]) == 2
    assert tree.insert(seq(6), [400]) == 0
    tree.check()
    assert tree.match(seq(1, 2, 4, 5)).pages == [100, 101, 202, 203]
    assert tree.match(seq(1, 2, 3)).pages == [100, 101, 102]
    assert tree.cached_pages == 6


def test_match_splits_a_node_at_the_page_where_it_diverges() -> None:
    tree = tree_with((seq(1, 2, 3, 4), [100, 101, 102, 103]))
    (node,) = tree.root.children.values()
    match = tree.match(seq(1, 2, 9))
    tree.check()
    assert match.pages == [100, 101]
    assert match.node.key == tuple(seq(1, 2)) and match.node.pages == [100, 101]
    assert node.parent is match.node and node.pages == [102, 103]  # the tail kept its identity


def test_match_that_ends_inside_a_node_splits_it_too() -> None:
    tree = tree_with((seq(1, 2, 3), [100, 101, 102]))
    match = tree.match([*seq(1), 20])  # one whole page, then a partial one
    assert match.node.pages == [100]
    assert [child.pages for child in match.node.children.values()] == [[101, 102]]
    tree.check()


def test_numpy_token_arrays_work_like_lists() -> None:
    tree = tree_with((seq(1, 2), [100, 101]))
    assert tree.match(np.array(seq(1, 2, 3), dtype=np.int32)).pages == [100, 101]
    assert tree.insert(np.array(seq(1, 5), dtype=np.int32), [200, 201]) == 1
    assert tree.match(seq(1, 5)).pages == [100, 201]
    tree.check()


def test_evict_goes_least_recently_used_first() -> None:
    tree = tree_with((seq(1), [100]), (seq(2), [200]), (seq(3), [300]))
    tree.match(seq(1))  # 1 is now the most recent; 2 the least
    assert tree.evict(1) == [200]
    assert tree.evict(1) == [300]
    assert tree.evict(5) == [100]
    assert tree.evict(1) == []
    assert tree.cached_pages == 0


def test_a_parent_becomes_evictable_when_its_last_child_goes() -> None:
    tree = tree_with((seq(1, 2, 3), [100, 101, 102]), (seq(1, 2, 4), [200, 201, 202]))
    # seq(1, 2) is one node with children 3 (older) and 4; its own time is the newest.
    assert tree.evict(1) == [102]
    assert tree.evict(1) == [202]
    assert tree.evict(1) == [100, 101]  # a whole node goes at once
    tree.check()


def test_locked_paths_are_never_evicted() -> None:
    tree = tree_with((seq(1, 2, 3), [100, 101, 102]), (seq(1, 4), [200, 201]))
    match = tree.match(seq(1, 2))
    tree.lock(match.node)
    assert (tree.protected_pages, tree.evictable_pages) == (2, 2)
    assert sorted(tree.evict(10)) == [102, 201]
    assert tree.match(seq(1, 2, 3)).pages == [100, 101]
    tree.unlock(match.node)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 2)
    assert tree.evict(10) == [101, 100]  # the leaf, then its parent
    tree.check()


def test_locks_nest_and_unlocking_below_zero_raises() -> None:
    tree = tree_with((seq(1, 2), [100, 101]))
    short, long = tree.match(seq(1)), tree.match(seq(1, 2))
    tree.lock(short.node)
    tree.lock(long.node)
    tree.lock(long.node)
    tree.check()
    assert tree.protected_pages == 2
    tree.unlock(long.node)
    tree.unlock(long.node)
    assert (tree.protected_pages, tree.evictable_pages) == (1, 1)
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(long.node)
    tree.unlock(short.node)
    tree.check()
    tree.lock(tree.root)  # an empty match locks nothing
    assert tree.protected_pages == 0


def test_a_split_keeps_a_locked_match_locked() -> None:
    tree = tree_with((seq(1, 2, 3), [100, 101, 102]))
    match = tree.match(seq(1, 2, 3))
    tree.lock(match.node)
    tree.insert(seq(1, 5), [200, 201])  # splits the locked node after its first page
    tree.check()
    assert tree.evict(10) == [201]
    tree.unlock(match.node)
    assert tree.protected_pages == 0
    tree.check()


def test_an_evicted_node_cannot_be_locked() -> None:
    tree = tree_with((seq(1), [100]))
    match = tree.match(seq(1))
    tree.evict(1)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(match.node)


def test_reset_returns_every_page_and_refuses_while_locked() -> None:
    tree = tree_with((seq(1, 2), [100, 101]), (seq(1, 3), [200, 201]))
    match = tree.match(seq(1))
    tree.lock(match.node)
    with pytest.raises(RuntimeError, match="locked"):
        tree.reset()
    tree.unlock(match.node)
    empty = tree.match([1])
    tree.lock(empty.node)  # an empty match locks the root, which protects nothing
    assert sorted(tree.reset()) == [100, 101, 201]
    assert tree.cached_pages == 0 and tree.match(seq(1)).pages == []
    tree.unlock(empty.node)  # the root survives a reset
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(match.node)  # a node from before the reset
    tree.check()


# ------------------------------------------------------------------------------ crafted: cache


def test_acquire_always_leaves_the_last_prompt_token_to_compute() -> None:
    cache = PrefixCache(PagePool(8), page_size=2)
    cache.tree.insert(seq(1, 2), [0, 1])
    assert cache.acquire(seq(1, 2)).pages == [0]  # the whole prompt is cached: one page less
    assert cache.acquire([*seq(1, 2), 30]).pages == [0, 1]


def test_release_follows_the_ownership_protocol() -> None:
    pool = PagePool(10)
    cache = PrefixCache(pool, page_size=2)
    first = cache.acquire(seq(1, 2, 3))
    pages_a = cache.alloc(3)
    assert first.pages == [] and pages_a == [0, 1, 2]
    # B starts before A finishes: same prompt, no hit yet.
    second = cache.acquire(seq(1, 2, 3))
    pages_b = cache.alloc(3)
    assert pages_b == [3, 4, 5]
    cache.release([*seq(1, 2, 3), 40], [*pages_a, *cache.alloc(1)], first)  # tail page 6 freed
    assert cache.tree.cached_pages == 3 and pool.num_free == 4
    cache.release(seq(1, 2, 3), pages_b, second)  # all duplicates: B's pages go back
    assert pool.num_free == 7
    third = cache.acquire([*seq(1, 2, 3), 40, 41])
    assert third.pages == [0, 1, 2]
    pages_c = [*third.pages, *cache.alloc(1)]
    cache.check()
    cache.release(seq(1, 2, 3, 4), pages_c, third)  # the matched pages stay the tree's
    assert cache.tree.cached_pages == 4 and cache.tree.protected_pages == 0
    cache.check()
    cache.reset()
    assert pool.num_free == 10


def test_release_refuses_pages_that_do_not_start_with_the_match() -> None:
    cache = PrefixCache(PagePool(4), page_size=2)
    cache.tree.insert(seq(1), [0])
    match = cache.acquire(seq(1, 2))
    with pytest.raises(ValueError, match="start with"):
        cache.release(seq(1, 2), [3], match)
    with pytest.raises(ValueError, match="fewer tokens"):
        cache.release([10], match.pages, match)


def test_alloc_evicts_when_short_and_evicts_nothing_when_it_cannot_help() -> None:
    pool = PagePool(4)
    cache = PrefixCache(pool, page_size=2)
    held = cache.alloc(3)
    assert held == [0, 1, 2]
    assert cache.alloc(2) is None and cache.tree.cached_pages == 0
    cache.release(seq(1, 2, 3), held, Match([], cache.tree.root, 0))
    assert (pool.num_free, cache.tree.cached_pages, cache.available_pages) == (1, 3, 4)
    locked = cache.acquire(seq(1, 9))  # keeps page 0 cached
    assert cache.alloc(4) is None and cache.tree.cached_pages == 3
    assert cache.alloc(3) == [1, 2, 3]
    assert cache.tree.cached_pages == 1
    cache.check()
    cache.release(seq(1), locked.pages, locked)
    cache.check()


def test_disabled_cache_never_keeps_a_page() -> None:
    pool = PagePool(4)
    cache = PrefixCache(pool, page_size=2, enabled=False)
    match = cache.acquire(seq(1, 2))
    cache.release(seq(1, 2), cache.alloc(2) or [], match)
    assert cache.acquire(seq(1, 2, 3)).pages == []
    assert pool.num_free == 4 and cache.tree.cached_pages == 0
    cache.check()
