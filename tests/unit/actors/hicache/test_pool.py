"""HostPool: a page-major segment named after the session, refused when /dev/shm lacks room."""

from __future__ import annotations

import pytest

from m3serve.actors.hicache.pool import HostPool, shm_free_bytes
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
