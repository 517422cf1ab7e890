"""StorageClient: the engine's side of the host-cache actor (actors/hicache/), which owns the
host KV pool's shared-memory segment and the L3 storage tier.

The engine asks for the host pool once (`open`), then issues Backups (host pages -> L3) and
Prefetches (L3 -> host pages). Each is a ticket, an asyncio.Future[int] resolved by the actor's
`Done` with how many pages L3 now holds (backup) or how many leading pages were found and are
now in their host pages (prefetch). The calls are plain functions, so the scheduler's synchronous
code can make them; messages leave in order through a sender task and replies come back through
a reader task, both on the engine's event loop. Only page ids and keys cross; pages stay in the
segment.

Page-reuse rule: a host page named by a pending ticket belongs to that ticket until it resolves
(cancelling the future does not free it). `busy(page)` tells the engine's host evictor which
pages to skip. A Prefetch into a busy page, or a Backup of a page a Prefetch is filling, is
refused with ValueError: the actor would read or write a page the engine also uses.

Death: the actor's process exiting (a pidfd on its pid), its going-down `Error` or a closed
mailbox marks the client dead. Every pending ticket fails with `HiCacheUnavailable` ("the
host-cache process died; HiCache is disabled"), one error line says the engine continues with
HiCache disabled, `alive` turns False and later calls raise the same error at once. A dead actor
touches no page, so the pages of the failed tickets are the engine's again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from m3serve.runtime.messages import (
    Backup,
    Done,
    Error,
    FromHiCache,
    HostPoolReady,
    HostPoolSpec,
    Prefetch,
    ToHiCache,
)
from m3serve.runtime.transport import Inbox, MailboxClosed, Outbox

log = logging.getLogger(__name__)

DIED = "the host-cache process died; HiCache is disabled"
CLOSED = "HiCache is shut down"
# Without pidfd support, how often the actor's pid is checked.
POLL_S = 0.25


class HiCacheUnavailable(RuntimeError):
    """The host-cache actor is gone (or the client closed): HiCache is disabled."""


class TicketRefused(RuntimeError):
    """The actor refused a ticket as invalid (pages out of range, mismatched lengths)."""


@dataclass
class _Ticket:
    future: asyncio.Future[int]
    pages: list[int]
    fills: bool  # a Prefetch: the actor writes these pages


class StorageClient:
    def __init__(
        self,
        to_actor: Outbox[ToHiCache],
        replies: Inbox[FromHiCache],
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self._to_actor = to_actor
        self._replies = replies
        self._on_death = on_death
        self._ids = itertools.count(1)
        self._tickets: dict[int, _Ticket] = {}
        self._read_by = Counter[int]()  # host page -> pending Backups reading it
        self._filled_by: set[int] = set()  # host pages a pending Prefetch writes
        self._outgoing: asyncio.Queue[ToHiCache] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: asyncio.Future[HostPoolReady] | None = None
        self._watched: int | None = None  # a pidfd the event loop watches
        self._poll: asyncio.TimerHandle | None = None
        self.dead: str | None = None  # why the client stopped (None while usable)
        self.why: str | None = None  # what made it stop, as the error line says

    @property
    def alive(self) -> bool:
        return self.dead is None

    @property
    def pending(self) -> int:
        """Tickets issued and not yet resolved."""
        return len(self._tickets)

    def busy(self, host_page: int) -> bool:
        """Whether a pending ticket owns `host_page` (the engine must not reuse it yet)."""
        return host_page in self._filled_by or self._read_by[host_page] > 0

    # ------------------------------------------------------------------ calls

    async def open(
        self, page_bytes: int, num_pages: int, timeout: float, ranks: int = 1
    ) -> HostPoolReady:
        """Have the actor make the host pool (one per rank of a tensor-parallel engine, in one
        segment); its answer names the segment to attach."""
        self._check_usable()
        self._pool = asyncio.get_running_loop().create_future()
        self._pool.add_done_callback(_mark_retrieved)  # it may fail after a timeout here
        self._send(HostPoolSpec(page_bytes, num_pages, ranks))
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._pool), timeout)
        except asyncio.TimeoutError:
            self._die(f"no answer to the host-pool request in {timeout:g}s")
            raise HiCacheUnavailable(DIED) from None
        if (ready.page_bytes, ready.num_pages, ready.ranks) != (page_bytes, num_pages, ranks):
            raise HiCacheUnavailable(
                f"the host pool exists with {ready.num_pages} pages of {ready.page_bytes} bytes"
                f" for {ready.ranks} ranks"
            )
        self.watch_process(ready.pid)
        return ready

    def backup(self, keys: Sequence[str], host_pages: Sequence[int]) -> asyncio.Future[int]:
        """Write these host pages to L3 under these keys, in the background."""
        pages = self._checked(keys, host_pages)
        filled = [h for h in pages if h in self._filled_by]
        if filled:
            raise ValueError(f"host pages {filled[:8]} are being filled by a prefetch")
        ticket = self._issue(pages, fills=False)
        self._read_by.update(pages)
        self._send(Backup(ticket, list(keys), pages))
        return self._tickets[ticket].future

    def prefetch(self, keys: Sequence[str], host_pages: Sequence[int]) -> asyncio.Future[int]:
        """Read the leading run of `keys` that L3 holds into `host_pages`; resolves with its
        length (the pages past it hold nothing to use)."""
        pages = self._checked(keys, host_pages)
        busy = [h for h in pages if self.busy(h)]
        if busy:
            raise ValueError(f"host pages {busy[:8]} belong to a pending ticket")
        ticket = self._issue(pages, fills=True)
        self._filled_by.update(pages)
        self._send(Prefetch(ticket, list(keys), pages))
        return self._tickets[ticket].future

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop using the actor: give pending tickets up to `drain_s` to finish, fail the rest."""
        if self._tickets and self.alive:
            futures = [t.future for t in self._tickets.values()]
            await asyncio.wait(futures, timeout=drain_s)
        if self.alive:
            self.dead = CLOSED
            self._stop(HiCacheUnavailable(CLOSED))
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _check_usable(self) -> None:
        if self.dead is not None:
            raise HiCacheUnavailable(self.dead)

    def _checked(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[int]:
        self._check_usable()
        pages = [int(h) for h in host_pages]
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} host pages")
        if len(set(pages)) != len(pages):
            raise ValueError("a host page is listed twice")
        return pages

    def _issue(self, pages: list[int], fills: bool) -> int:
        ticket = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        # The engine may never await a backup; its failure at death is logged once, here.
        future.add_done_callback(_mark_retrieved)
        self._tickets[ticket] = _Ticket(future, pages, fills)
        return ticket

    def _send(self, msg: ToHiCache) -> None:
        if self._outgoing is None:
            self._start()
        assert self._outgoing is not None
        self._outgoing.put_nowait(msg)

    # ------------------------------------------------------------------ tasks

    def _start(self) -> None:
        self._outgoing = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="hicache-send"),
            asyncio.create_task(self._read_loop(), name="hicache-read"),
        ]

    async def _send_loop(self) -> None:
        assert self._outgoing is not None
        while True:
            msg = await self._outgoing.get()
            try:
                await self._to_actor.send(msg)
            except MailboxClosed:
                self._die("its mailbox is closed")
                return

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = await self._replies.recv()
            except MailboxClosed:
                self._die("the reply mailbox is closed")
                return
            if isinstance(msg, Done):
                self._resolve(msg)
            elif isinstance(msg, HostPoolReady):
                if self._pool is not None and not self._pool.done():
                    self._pool.set_result(msg)
            elif isinstance(msg, Error) and msg.rid is None:
                self._die(msg.message)
                return

    def _resolve(self, done: Done) -> None:
        ticket = self._tickets.pop(done.ticket, None)
        if ticket is None:
            return  # failed already (the client was closing)
        self._release(ticket)
        if ticket.future.done():
            return  # its caller cancelled it
        if done.error is not None:
            ticket.future.set_exception(TicketRefused(done.error))
        else:
            ticket.future.set_result(done.pages)

    def _release(self, ticket: _Ticket) -> None:
        if ticket.fills:
            self._filled_by.difference_update(ticket.pages)
        else:
            self._read_by.subtract(ticket.pages)
            for h in ticket.pages:
                if self._read_by[h] <= 0:
                    del self._read_by[h]

    # ------------------------------------------------------------------ death

    def watch_process(self, pid: int) -> None:
        """Notice the actor's process exiting (not needed for an actor in this process, whose
        going-down Error always arrives)."""
        if pid == os.getpid() or self._watched is not None or self._poll is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._die(f"pid {pid} is gone")
            return
        except (AttributeError, OSError):  # no pidfd here: poll instead
            self._poll = loop.call_later(POLL_S, self._poll_pid, pid)
            return
        loop.add_reader(fd, self._die, f"pid {pid} exited")
        self._watched = fd

    def _poll_pid(self, pid: int) -> None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            self._poll = None
            self._die(f"pid {pid} exited")
            return
        except PermissionError:
            pass  # alive, owned by someone else
        self._poll = asyncio.get_running_loop().call_later(POLL_S, self._poll_pid, pid)

    def _die(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead, self.why = DIED, why
        log.error("%s (%s); the engine continues with HiCache disabled", DIED, why)
        self._stop(HiCacheUnavailable(DIED))
        if self._on_death is not None:
            self._on_death(DIED)

    def _stop(self, error: HiCacheUnavailable) -> None:
        """Fail every pending ticket, stop watching, stop the tasks, close the mailboxes."""
        for ticket in self._tickets.values():
            if not ticket.future.done():
                ticket.future.set_exception(error)
        self._tickets.clear()
        self._read_by.clear()
        self._filled_by.clear()
        if self._pool is not None and not self._pool.done():
            self._pool.set_exception(error)
        if self._watched is not None:
            asyncio.get_running_loop().remove_reader(self._watched)
            os.close(self._watched)
            self._watched = None
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._to_actor.close()
        self._replies.close()


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
