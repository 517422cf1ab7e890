"""HostPool: a page-major segment named after the session, refused when /dev/shm lacks room; with
tensor parallelism one pool per rank in it, each rank's piece of a page stored under its own
key."""

from __future__ import annotations

import pytest

from m3serve.actors.hicache.pool import HostPool, rank_key, shm_free_bytes
from m3serve.actors.hicache.storage import is_key
from m3serve.runtime.shm import SHM_DIR, list_session_segments, new_session_id

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


def test_pages_are_disjoint_slices_and_close_unlinks() -> None:
    session = new_session_id()
    pool = HostPool(session, 16, 3)
    assert list_session_segments(session) == [pool.name]
    for h in range(3):
        with pool.page(h) as page:
            page[:] = bytes([h + 1]) * 16
    with pool.page(1) as page:
        assert bytes(page) == b"\x02" * 16
    assert pool.problem(["a", "b"], [0, 3]) == "host pages out of range 0..2: [3]"
    assert pool.problem(["a"], [0, 1]) == "1 keys for 2 host pages"
    assert pool.problem(["a", "b"], [1, 1]) == "a host page is listed twice"
    assert pool.problem(["a"], [2]) is None
    pool.close()
    assert list_session_segments(session) == []


def test_a_pool_larger_than_the_free_shared_memory_is_refused() -> None:
    session = new_session_id()
    with pytest.raises(ValueError, match="does not fit in /dev/shm"):
        HostPool(session, 2**20, shm_free_bytes() // 2**20 + 1)
    assert list_session_segments(session) == []


def test_each_rank_has_its_own_pool_in_the_segment() -> None:
    session = new_session_id()
    pool = HostPool(session, 8, 3, ranks=2)
    for rank in range(2):
        for h in range(3):
            with pool.page(h, rank) as page:
                page[:] = bytes([10 * rank + h]) * 8
    with pool.page(2, 1) as page:
        assert bytes(page) == bytes([12]) * 8
    with pool.page(0) as page:  # rank 0's, as with one rank
        assert bytes(page) == bytes([0]) * 8
    pool.close()


def test_rank_keys_are_the_key_with_one_rank_and_distinct_keys_with_more() -> None:
    key = "ab" * 16
    assert rank_key(key, 0, 1) == key
    two = [rank_key(key, r, 2) for r in range(2)]
    four = [rank_key(key, r, 4) for r in range(4)]
    assert len(set(two + four + [key])) == 7
    assert all(is_key(k) and len(k) == len(key) for k in two + four)
