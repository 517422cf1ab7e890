"""PagePool (m3serve.core.kvcache.pages): ids are never handed out twice, alloc is all or
nothing, and a bad free is loud and changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from m3serve.core.kvcache.pages import PagePool


def test_alloc_hands_out_lowest_ids_first() -> None:
    pool = PagePool(6)
    assert pool.alloc(2) == [0, 1]
    assert pool.alloc(1) == [2]
    pool.free([0])
    assert pool.alloc(2) == [0, 3]
    assert (pool.num_free, pool.num_pages) == (2, 6)


def test_alloc_is_all_or_nothing() -> None:
    pool = PagePool(4)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2) is None
    assert pool.num_free == 1
    assert pool.alloc(0) == []
    assert pool.alloc(1) == [3]
    with pytest.raises(ValueError):
        pool.alloc(-1)


@pytest.mark.parametrize(
    ("pages", "message"),
    [([1], "double free"), ([0, 0], "double free"), ([4], "out of range"), ([-1], "out of range")],
)
def test_bad_free_raises_and_frees_nothing(pages: list[int], message: str) -> None:
    pool = PagePool(4)
    pool.alloc(1)  # page 0 is allocated, 1..3 are free
    with pytest.raises(ValueError, match=message):
        pool.free(pages)
    assert pool.num_free == 3
    pool.check()


def test_a_bad_page_anywhere_in_the_call_frees_none_of_it() -> None:
    pool = PagePool(4)
    pool.alloc(3)
    with pytest.raises(ValueError, match="double free"):
        pool.free([0, 1, 3])
    assert pool.num_free == 1
    pool.check()


class PagePoolMachine(RuleBasedStateMachine):
    """Random allocs and frees against a model: the set of ids each caller holds."""

    @initialize(num_pages=st.integers(0, 24))
    def start(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages)
        self.held: set[int] = set()

    @rule(n=st.integers(0, 10))
    def alloc(self, n: int) -> None:
        free_before = self.pool.num_free
        pages = self.pool.alloc(n)
        if n > free_before:
            assert pages is None
            assert self.pool.num_free == free_before
            return
        assert pages is not None and len(pages) == n
        assert pages == sorted(set(pages)), "ids must be distinct, lowest first"
        assert self.held.isdisjoint(pages), "an id was handed out twice"
        self.held.update(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.pool.free(pages)
        self.held.difference_update(pages)

    @rule(data=st.data())
    def double_free_is_loud(self, data: st.DataObject) -> None:
        free = sorted(set(range(self.pool.num_pages)) - self.held)
        if not free:
            return
        page = data.draw(st.sampled_from(free))
        with pytest.raises(ValueError):
            self.pool.free([*sorted(self.held), page])

    @invariant()
    def partition(self) -> None:
        self.pool.check()
        assert self.pool.num_free == self.pool.num_pages - len(self.held)


TestPagePoolMachine = PagePoolMachine.TestCase
TestPagePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
