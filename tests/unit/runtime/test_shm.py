"""Shared-memory segments: hand-over between processes, cleanup by session, token-id packing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from m3serve.runtime.messages import ShmRef, TokenIds
from m3serve.runtime.shm import (
    SHM_DIR,
    list_session_segments,
    new_session_id,
    pack_token_ids,
    read_array,
    remove_session_segments,
    unpack_token_ids,
    write_array,
)

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def session() -> Iterator[str]:
    sid = new_session_id()
    yield sid
    remove_session_segments(sid)


def exists(ref: ShmRef) -> bool:
    return (SHM_DIR / ref.name).exists()


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8, np.float64])
def test_an_array_round_trips_through_a_segment(session: str, dtype: type) -> None:
    arr = (np.arange(3000) % 251).astype(dtype).reshape(30, 100)
    ref = write_array(arr, session)
    assert ref.nbytes == arr.nbytes
    out = read_array(ref, dtype)
    assert out.dtype == dtype
    assert np.array_equal(out, arr.reshape(-1))


def test_segments_are_named_by_session_and_visible_in_dev_shm(session: str) -> None:
    ref = write_array(np.arange(10), session)
    assert ref.name.startswith(f"m3s-{session}-")
    assert list_session_segments(session) == [ref.name]
    assert exists(ref)


def test_reading_a_segment_unlinks_it(session: str) -> None:
    ref = write_array(np.arange(10), session)
    read_array(ref, np.int64)
    assert not exists(ref)
    assert list_session_segments(session) == []


def test_reading_without_unlink_leaves_the_segment_for_a_later_read(session: str) -> None:
    ref = write_array(np.arange(10), session)
    first = read_array(ref, np.int64, unlink=False)
    assert exists(ref)
    assert np.array_equal(read_array(ref, np.int64), first)
    assert not exists(ref)


def test_an_empty_array_round_trips(session: str) -> None:
    ref = write_array(np.zeros(0, np.int32), session)
    assert ref.nbytes == 0
    assert read_array(ref, np.int32).size == 0
    assert not exists(ref)


def test_reading_with_a_dtype_that_does_not_divide_the_size_is_refused(session: str) -> None:
    ref = write_array(np.zeros(3, np.uint8), session)
    with pytest.raises(ValueError, match="whole number"):
        read_array(ref, np.int32)


def test_remove_session_segments_removes_that_sessions_leftovers_only(session: str) -> None:
    other = new_session_id()
    try:
        leftovers = [write_array(np.arange(i + 1), session) for i in range(3)]
        kept = write_array(np.arange(4), other)
        assert remove_session_segments(session) == 3
        assert not any(exists(ref) for ref in leftovers)
        assert list_session_segments(session) == []
        assert list_session_segments(other) == [kept.name]
    finally:
        remove_session_segments(other)


def test_session_ids_that_could_match_another_sessions_prefix_are_refused() -> None:
    with pytest.raises(ValueError, match="letters or digits"):
        list_session_segments("ab-c")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )


def test_a_segment_outlives_its_writer_and_no_process_warns_about_it(session: str) -> None:
    writer = run_python(
        "import numpy as np\n"
        "from m3serve.runtime.shm import write_array\n"
        f"ref = write_array(np.arange(1000, dtype=np.int32), {session!r})\n"
        "print(ref.name, ref.nbytes)\n"
    )
    assert writer.returncode == 0, writer.stderr
    name, nbytes = writer.stdout.split()
    # The writer has exited; its resource_tracker must not have unlinked the segment.
    assert list_session_segments(session) == [name]

    reader = run_python(
        "import numpy as np\n"
        "from m3serve.runtime.messages import ShmRef\n"
        "from m3serve.runtime.shm import read_array\n"
        f"print(int(read_array(ShmRef({name!r}, {nbytes}), np.int32).sum()))\n"
    )
    assert reader.returncode == 0, reader.stderr
    assert int(reader.stdout) == sum(range(1000))
    for stderr in (writer.stderr, reader.stderr):
        assert "leaked" not in stderr
        assert "resource_tracker" not in stderr
    assert list_session_segments(session) == []


def test_short_token_ids_travel_inline(session: str) -> None:
    t = pack_token_ids([5, 6, 7], session)
    assert t.count == 3
    assert t.shm is None
    assert t.array is not None
    assert t.array.dtype == np.int32
    assert unpack_token_ids(t).tolist() == [5, 6, 7]


def test_token_ids_at_the_threshold_travel_in_shared_memory(session: str) -> None:
    ids = np.arange(256, dtype=np.int32)  # 1024 bytes
    below = pack_token_ids(ids[:-1], session, shm_threshold_bytes=ids.nbytes)
    at = pack_token_ids(ids, session, shm_threshold_bytes=ids.nbytes)
    assert below.shm is None
    assert at.array is None
    assert at.shm is not None
    assert np.array_equal(unpack_token_ids(at), ids)
    assert list_session_segments(session) == []


def test_a_long_prompt_uses_shared_memory_by_default(session: str) -> None:
    ids = list(range(20_000))
    t = pack_token_ids(ids, session)
    assert t.shm is not None
    assert unpack_token_ids(t).tolist() == ids


def test_int64_token_ids_are_narrowed_to_int32(session: str) -> None:
    t = pack_token_ids(np.array([1, 2**31 - 1], np.int64), session)
    assert unpack_token_ids(t).dtype == np.int32
    assert unpack_token_ids(t).tolist() == [1, 2**31 - 1]


def test_no_token_ids_pack_to_an_empty_int32_array(session: str) -> None:
    out = unpack_token_ids(pack_token_ids([], session))
    assert out.dtype == np.int32
    assert out.size == 0


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (np.array([2**31], np.int64), ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (np.zeros((2, 2), np.int32), ValueError),
    ],
    ids=["out-of-range", "floats", "two-dimensional"],
)
def test_token_ids_that_are_not_int32_values_are_refused(
    session: str, ids: np.ndarray, error: type[Exception]
) -> None:
    with pytest.raises(error):
        pack_token_ids(ids, session)


def test_unpacking_checks_the_count() -> None:
    with pytest.raises(ValueError, match="says 4 ids but 3 arrived"):
        unpack_token_ids(TokenIds(count=4, array=np.arange(3, dtype=np.int32)))
    with pytest.raises(ValueError, match="neither"):
        unpack_token_ids(TokenIds(count=4))
