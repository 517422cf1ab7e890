"""HiCacheActor in this process, over real ZeroMQ mailboxes and a real shared-memory pool: the
engine's StorageClient backs host pages up to files and prefetches them back byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from m3serve.actors.hicache import HiCacheActor
from m3serve.actors.hicache.file_storage import FileStorage
from m3serve.actors.hicache.pool import shm_free_bytes
from m3serve.actors.hicache.storage import StorageBackend
from m3serve.core.hicache.keys import page_keys, root_key
from m3serve.core.hicache.storage_client import (
    DIED,
    HiCacheUnavailable,
    StorageClient,
    TicketRefused,
)
from m3serve.runtime.codec import Codec
from m3serve.runtime.messages import FromHiCache, Shutdown, ToHiCache
from m3serve.runtime.shm import (
    SHM_DIR,
    attach_segment,
    list_session_segments,
    new_session_id,
    remove_session_segments,
)
from m3serve.runtime.transport import ZmqInbox, ZmqOutbox, ipc_address

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

PAGE_BYTES = 8192
NUM_PAGES = 8
PATIENCE_S = 10.0
ROOT = root_key("tiny", 16, "float32")
KEYS = page_keys(ROOT, list(range(4 * 16)), 16)
OTHER = page_keys(ROOT, list(range(1000, 1000 + 4 * 16)), 16)


@dataclass
class Wired:
    actor: HiCacheActor
    client: StorageClient  # the engine's
    session: str
    run: Path  # the socket files
    served: asyncio.Task[None]

    async def stop_actor(self) -> None:
        if self.served.done():
            return
        stop = ZmqOutbox(ipc_address(self.run, "hc"), Codec(ToHiCache))
        await stop.send(Shutdown())
        await asyncio.wait_for(self.served, PATIENCE_S)
        stop.close()


@contextlib.asynccontextmanager
async def started(storage: StorageBackend | None) -> AsyncIterator[Wired]:
    """An actor serving in this event loop behind ZeroMQ sockets, and the engine's client."""
    run = Path(tempfile.mkdtemp(prefix="m3hc"))  # short: ipc paths are limited to 107 bytes
    session = new_session_id()
    actor = HiCacheActor(
        ZmqInbox(ipc_address(run, "hc"), Codec(ToHiCache)),
        ZmqOutbox(ipc_address(run, "hc-reply"), Codec(FromHiCache)),
        None,
        session,
        storage,
    )
    client = StorageClient(
        ZmqOutbox(ipc_address(run, "hc"), Codec(ToHiCache)),
        ZmqInbox(ipc_address(run, "hc-reply"), Codec(FromHiCache)),
    )
    wired = Wired(actor, client, session, run, asyncio.create_task(actor.serve()))
    try:
        yield wired
    finally:
        await client.close(drain_s=PATIENCE_S)
        await wired.stop_actor()
        shutil.rmtree(run, ignore_errors=True)
        remove_session_segments(session)


@pytest.fixture
async def wired(tmp_path: Path) -> AsyncIterator[Wired]:
    async with started(FileStorage(tmp_path / "store")) as wired:
        yield wired


async def wait(future: asyncio.Future[int]) -> int:
    return await asyncio.wait_for(future, PATIENCE_S)


class Pool:
    """The engine's view of the host pool: the segment attached, one row per page."""

    def __init__(self, segment: str) -> None:
        self.shm = attach_segment(segment)
        self.pages = np.frombuffer(self.shm.buf, np.uint8).reshape(NUM_PAGES, PAGE_BYTES)

    def close(self) -> None:
        del self.pages
        self.shm.close()


async def opened(wired: Wired) -> Pool:
    ready = await wired.client.open(PAGE_BYTES, NUM_PAGES, timeout=PATIENCE_S)
    assert (ready.page_bytes, ready.num_pages) == (PAGE_BYTES, NUM_PAGES)
    assert list_session_segments(wired.session) == [ready.segment]
    return Pool(ready.segment)


def fill(pool: Pool, pages: list[int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool.pages[pages] = rng.integers(0, 256, (len(pages), PAGE_BYTES), dtype=np.uint8)
    return pool.pages[pages].copy()


async def test_backed_up_pages_come_back_byte_for_byte(wired: Wired) -> None:
    pool = await opened(wired)
    try:
        original = fill(pool, [0, 1, 2, 3], seed=1)
        assert await wait(wired.client.backup(KEYS, [0, 1, 2, 3])) == 4
        store = wired.actor.storage
        assert isinstance(store, FileStorage)
        assert sorted(p.name for p in store.root.glob("*/*")) == sorted(KEYS)
        pool.pages[:] = 0
        assert await wait(wired.client.prefetch(KEYS, [7, 6, 5, 4])) == 4
        assert np.array_equal(pool.pages[[7, 6, 5, 4]], original)
        assert wired.client.pending == 0
    finally:
        pool.close()


async def test_a_prefetch_reports_the_leading_pages_found(wired: Wired) -> None:
    pool = await opened(wired)
    try:
        original = fill(pool, [0, 1], seed=2)
        assert await wait(wired.client.backup(KEYS[:2], [0, 1])) == 2
        # Only the first two of four exist: 2.
        assert await wait(wired.client.prefetch(KEYS, [4, 5, 6, 7])) == 2
        assert np.array_equal(pool.pages[[4, 5]], original)
        # A gap ends the run: the page after a missing one is of no use.
        gap = [KEYS[0], OTHER[1], KEYS[1]]
        assert await wait(wired.client.prefetch(gap, [4, 5, 6])) == 1
        assert await wait(wired.client.prefetch(OTHER, [4, 5, 6, 7])) == 0
    finally:
        pool.close()


async def test_a_prefetch_right_after_its_backup_finds_the_pages(wired: Wired) -> None:
    pool = await opened(wired)
    try:
        original = fill(pool, [0, 1, 2, 3], seed=3)
        backup = wired.client.backup(KEYS, [0, 1, 2, 3])
        prefetch = wired.client.prefetch(KEYS, [4, 5, 6, 7])  # sent before the backup is done
        assert (await wait(backup), await wait(prefetch)) == (4, 4)
        assert np.array_equal(pool.pages[4:], original)
    finally:
        pool.close()


async def test_a_replica_prefetches_what_another_one_stored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    async with started(FileStorage(store)) as first:
        pool = await opened(first)
        original = fill(pool, [0, 1], seed=4)
        assert await wait(first.client.backup(KEYS[:2], [0, 1])) == 2
        pool.close()
    async with started(FileStorage(store)) as replica:
        pool = await opened(replica)
        assert await wait(replica.client.prefetch(KEYS, [0, 1, 2, 3])) == 2
        assert np.array_equal(pool.pages[:2], original)
        pool.close()


async def test_an_invalid_ticket_is_refused_without_touching_the_pool(wired: Wired) -> None:
    pool = await opened(wired)
    try:
        with pytest.raises(TicketRefused, match="out of range"):
            await wait(wired.client.prefetch(KEYS[:1], [NUM_PAGES]))
        with pytest.raises(TicketRefused, match="not page keys"):
            await wait(wired.client.backup(["../../etc/passwd"], [0]))
        assert wired.client.alive
    finally:
        pool.close()


class FailingStorage(FileStorage):
    """A disk that fails for one key."""

    def __init__(self, root: Path, bad: str) -> None:
        super().__init__(root)
        self.bad = bad

    def put(self, key: str, page: memoryview) -> bool:
        if key == self.bad:
            raise OSError(28, "No space left on device")
        return super().put(key, page)

    def get(self, key: str, out: memoryview) -> bool:
        if key == self.bad:
            raise OSError(5, "Input/output error")
        return super().get(key, out)


async def test_storage_errors_lower_the_count_and_nothing_else(tmp_path: Path) -> None:
    async with started(FailingStorage(tmp_path / "store", bad=KEYS[1])) as wired:
        pool = await opened(wired)
        fill(pool, [0, 1, 2, 3], seed=5)
        assert await wait(wired.client.backup(KEYS, [0, 1, 2, 3])) == 3
        # KEYS[1] was never stored: the run ends before it.
        assert await wait(wired.client.prefetch(KEYS, [4, 5, 6, 7])) == 1
        # Stored but unreadable: the same.
        store = wired.actor.storage
        assert isinstance(store, FailingStorage)
        assert FileStorage.put(store, KEYS[1], memoryview(bytes(PAGE_BYTES)))
        assert await wait(wired.client.prefetch(KEYS, [4, 5, 6, 7])) == 1
        assert wired.client.alive and wired.client.pending == 0
        pool.close()


async def test_without_storage_nothing_is_stored_or_found() -> None:
    async with started(None) as wired:
        pool = await opened(wired)
        assert await wait(wired.client.backup(KEYS[:1], [0])) == 0
        assert await wait(wired.client.prefetch(KEYS[:1], [1])) == 0
        pool.close()


async def test_shutdown_unlinks_the_pool_and_tells_the_engine(wired: Wired) -> None:
    pool = await opened(wired)
    pool.close()
    await wired.stop_actor()
    assert list_session_segments(wired.session) == []
    for _ in range(100):  # the going-down notice arrives through the reply mailbox
        if not wired.client.alive:
            break
        await asyncio.sleep(0.02)
    assert not wired.client.alive


async def test_a_pool_that_cannot_be_made_disables_hicache_at_once(wired: Wired) -> None:
    too_many = shm_free_bytes() // PAGE_BYTES + 1
    with pytest.raises(HiCacheUnavailable, match=DIED):
        await wired.client.open(PAGE_BYTES, too_many, timeout=PATIENCE_S)  # not the timeout
    with pytest.raises(ValueError, match="does not fit"):
        await asyncio.wait_for(wired.served, PATIENCE_S)  # the actor went down, saying why
    assert list_session_segments(wired.session) == []
