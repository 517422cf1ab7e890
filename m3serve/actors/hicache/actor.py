"""HiCacheActor: the host-pool process. It owns the host KV pool's shared-memory segment and the
L3 storage tier, and moves whole pages between the two on the engine's request.

Message flow (runtime/messages.py, "engine <-> host cache"): the engine sends `HostPoolSpec`
once and gets `HostPoolReady` (the segment to attach); then any number of `Backup` (write these
host pages to L3) and `Prefetch` (read the leading run of these keys that L3 holds into these host
pages), each answered by one `Done` with its ticket. Tickets run concurrently on a small pool of
I/O threads, so a slow disk never holds up the actor's inbox. A host page belongs to its ticket
until the `Done`; the actor touches it only in between.

At shutdown the actor lets pending tickets finish, unlinks the segment and tells the engine it is
going (an `Error` without rid). If the process dies instead, the engine notices the exit itself
(`StorageClient` watches the pid) and the supervisor's session cleanup removes the segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from m3serve.actors.hicache.pool import HostPool
from m3serve.actors.hicache.storage import StorageBackend, is_key
from m3serve.runtime.actor import Actor, handles
from m3serve.runtime.messages import Backup, Done, Error, HostPoolReady, HostPoolSpec, Prefetch
from m3serve.runtime.transport import Inbox, MailboxClosed, Outbox

log = logging.getLogger(__name__)

T = TypeVar("T")
Work = Callable[[Sequence[str], Sequence[int]], Awaitable[int]]  # what a ticket does

IO_THREADS = 4
# At shutdown, how long pending tickets get to finish before the pool is unlinked anyway.
DRAIN_S = 30.0


class HiCacheActor(Actor):
    name = "hicache"

    def __init__(
        self,
        inbox: Inbox,
        engine: Outbox,
        control: Outbox | None,
        session: str,
        storage: StorageBackend | None,
        io_threads: int = IO_THREADS,
    ) -> None:
        super().__init__(inbox, control)
        self.engine = engine
        self.session = session
        self.storage = storage
        self.pool: HostPool | None = None
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-io")
        self._tickets: set[asyncio.Task[None]] = set()
        # key -> the write of it in flight (its result: stored); a Prefetch of the key waits.
        self._writing: dict[str, asyncio.Future[bool]] = {}

    async def on_start(self) -> dict[str, Any]:
        return {"hicache_storage": self.storage.name if self.storage else None}

    async def on_stop(self) -> None:
        if self._tickets:
            await asyncio.wait(self._tickets, timeout=DRAIN_S)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        with contextlib.suppress(Exception):  # the engine may be gone already
            await self.engine.send(Error(None, "the host-cache actor stopped", actor=self.name))

    # ------------------------------------------------------------------ messages

    @handles(HostPoolSpec)
    async def on_pool_spec(self, msg: HostPoolSpec) -> None:
        if self.pool is None:
            self.pool = HostPool(self.session, msg.page_bytes, msg.num_pages, msg.ranks)
            size_gib = msg.page_bytes * msg.num_pages * msg.ranks / 2**30
            per = f" per rank x {msg.ranks} ranks" if msg.ranks > 1 else ""
            log.info(
                "host pool %s: %d pages%s, %.2f GiB", self.pool.name, msg.num_pages, per, size_gib
            )
        # A repeated spec gets the pool that exists; the client refuses one that differs.
        pool = self.pool
        ready = HostPoolReady(pool.name, pool.page_bytes, pool.num_pages, os.getpid(), pool.ranks)
        await self.engine.send(ready)

    @handles(Backup)
    async def on_backup(self, msg: Backup) -> None:
        await self._start(msg, self._backup)

    @handles(Prefetch)
    async def on_prefetch(self, msg: Prefetch) -> None:
        await self._start(msg, self._prefetch)

    async def _start(self, msg: Backup | Prefetch, work: Work) -> None:
        pool = self.pool
        problem = pool.problem(msg.keys, msg.host_pages) if pool else "no host pool yet"
        bad_keys = [key for key in msg.keys if not is_key(key)]
        if problem is None and bad_keys:
            problem = f"not page keys: {bad_keys[:4]}"
        if problem is not None:
            await self.engine.send(Done(msg.ticket, 0, problem))
            return
        task = asyncio.create_task(
            self._finish(msg.ticket, work(msg.keys, msg.host_pages)), name=f"ticket{msg.ticket}"
        )
        self._tickets.add(task)
        task.add_done_callback(self._tickets.discard)

    async def _finish(self, ticket: int, work: Awaitable[int]) -> None:
        try:
            done = Done(ticket, await work)
        except Exception as exc:
            log.exception("ticket %d failed", ticket)
            done = Done(ticket, 0, repr(exc))
        with contextlib.suppress(MailboxClosed):  # the engine stopped listening
            await self.engine.send(done)

    # ------------------------------------------------------------------ backup

    def _backup(self, keys: Sequence[str], pages: Sequence[int]) -> Awaitable[int]:
        """Claims the keys at once, so that a Prefetch handled next waits for their writes, and
        writes them in the background."""
        if self.storage is None:
            return _nothing()
        loop = asyncio.get_running_loop()
        writes: list[Awaitable[bool]] = []
        for key, h in zip(keys, pages, strict=True):
            running = self._writing.get(key)
            if running is None:
                running = self._writing[key] = loop.create_future()
                writes.append(self._write(key, h, running))
            else:  # another ticket is writing the same page now
                writes.append(asyncio.shield(running))
        return _count(writes)

    async def _write(self, key: str, h: int, written: asyncio.Future[bool]) -> bool:
        ok = False
        try:
            ok = await self._in_thread(self._put, key, h)
        finally:
            del self._writing[key]
            written.set_result(ok)
        return ok

    def _put(self, key: str, h: int) -> bool:
        """Every rank's piece of host page `h`, each under its own key."""
        pool, storage = self.pool, self.storage
        assert pool is not None and storage is not None
        try:
            for rank, piece_key in enumerate(pool.rank_keys(key)):
                with pool.page(h, rank) as page:
                    storage.put(piece_key, page)
        except OSError as exc:
            log.warning("L3 write of page %s failed: %s", key[:12], exc)
            return False
        return True

    # ------------------------------------------------------------------ prefetch

    async def _prefetch(self, keys: Sequence[str], pages: Sequence[int]) -> int:
        if self.storage is None:
            return 0
        for key in keys:  # a page being written now is found once it is written
            running = self._writing.get(key)
            if running is not None:
                await asyncio.shield(running)
        found = await self._in_thread(self._leading_stored, keys)
        leading = zip(keys[:found], pages[:found], strict=True)
        read = await _all_finished([self._in_thread(self._get, k, h) for k, h in leading])
        # A page that vanished between the check and the read ends the run there.
        return read.index(False) if False in read else found

    def _leading_stored(self, keys: Sequence[str]) -> int:
        """How many leading pages L3 holds whole: every rank's piece of each."""
        pool, storage = self.pool, self.storage
        assert pool is not None and storage is not None
        for i, key in enumerate(keys):
            try:
                if not all(storage.exists(k) for k in pool.rank_keys(key)):
                    return i
            except OSError as exc:
                log.warning("L3 lookup of page %s failed: %s", key[:12], exc)
                return i
        return len(keys)

    def _get(self, key: str, h: int) -> bool:
        """Every rank's piece of the page into host page `h`; False if any is missing."""
        pool, storage = self.pool, self.storage
        assert pool is not None and storage is not None
        try:
            for rank, piece_key in enumerate(pool.rank_keys(key)):
                with pool.page(h, rank) as page:
                    if not storage.get(piece_key, page):
                        return False
            return True
        except OSError as exc:
            log.warning("L3 read of page %s failed: %s", key[:12], exc)
            return False

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)


async def _count(writes: list[Awaitable[bool]]) -> int:
    return sum(await _all_finished(writes))


async def _all_finished(steps: list[Awaitable[bool]]) -> list[bool]:
    """Each step's outcome, an exception counting as False. Waits for every step, so no I/O
    thread still uses a page of the ticket when its Done goes out."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for failure in {repr(r) for r in results if isinstance(r, BaseException)}:
        log.warning("L3 page I/O failed: %s", failure)
    return [r is True for r in results]


async def _nothing() -> int:
    return 0
