"""StorageClient against a scripted actor on in-process mailboxes: the page-reuse rule, refused
tickets, and what happens to pending and later calls when the actor goes away."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from m3serve.core.hicache.storage_client import (
    DIED,
    HiCacheUnavailable,
    StorageClient,
    TicketRefused,
)
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
from m3serve.runtime.transport import Inbox, InProcChannel, Outbox

KEYS = ["ab" * 32, "cd" * 32, "ef" * 32]
PATIENCE_S = 5.0


class Scripted:
    """The actor's side of the mailboxes, driven by the test."""

    def __init__(self) -> None:
        requests: InProcChannel[ToHiCache] = InProcChannel()
        replies: InProcChannel[FromHiCache] = InProcChannel()
        self.inbox: Inbox[ToHiCache] = requests.inbox()
        self.outbox: Outbox[FromHiCache] = replies.outbox()
        self.deaths: list[str] = []
        self.client = StorageClient(requests.outbox(), replies.inbox(), self.deaths.append)

    async def recv(self) -> ToHiCache:
        return await asyncio.wait_for(self.inbox.recv(), PATIENCE_S)

    async def next_ticket(self) -> int:
        msg = await self.recv()
        assert isinstance(msg, (Backup, Prefetch))
        return msg.ticket

    async def open(self, pid: int | None = None) -> None:
        opening = asyncio.create_task(self.client.open(64, 4, timeout=PATIENCE_S))
        assert await self.recv() == HostPoolSpec(64, 4)
        await self.outbox.send(HostPoolReady("m3s-x-1", 64, 4, pid or os.getpid()))
        await opening


@pytest.fixture
async def scripted() -> Scripted:
    return Scripted()


async def test_a_ticket_resolves_with_the_actors_count(scripted: Scripted) -> None:
    await scripted.open()
    prefetch = scripted.client.prefetch(KEYS, [0, 1, 2])
    assert scripted.client.pending == 1
    msg = await scripted.recv()
    assert isinstance(msg, Prefetch) and msg.keys == KEYS and msg.host_pages == [0, 1, 2]
    await scripted.outbox.send(Done(msg.ticket, 2))
    assert await asyncio.wait_for(prefetch, PATIENCE_S) == 2
    assert scripted.client.pending == 0


async def test_a_page_stays_with_its_ticket_until_done(scripted: Scripted) -> None:
    await scripted.open()
    client = scripted.client
    backup = client.backup(KEYS[:2], [0, 1])
    assert client.busy(0) and client.busy(1) and not client.busy(2)
    # Filling a page a backup still reads would corrupt what is written: refused.
    with pytest.raises(ValueError, match="pending ticket"):
        client.prefetch(KEYS[2:], [1])
    # Reading it twice is fine.
    second = client.backup(KEYS[:1], [0])
    prefetch = client.prefetch(KEYS[2:], [2])
    # Backing up a page a prefetch is filling would store what is not there yet: refused.
    with pytest.raises(ValueError, match="filled by a prefetch"):
        client.backup(KEYS[2:], [2])
    tickets = [await scripted.next_ticket() for _ in range(3)]
    await scripted.outbox.send(Done(tickets[0], 2))
    assert await asyncio.wait_for(backup, PATIENCE_S) == 2
    assert client.busy(0) and not client.busy(1)  # the second backup still reads page 0
    for ticket, future in zip(tickets[1:], (second, prefetch), strict=True):
        await scripted.outbox.send(Done(ticket, 1))
        await asyncio.wait_for(future, PATIENCE_S)
    assert not any(client.busy(h) for h in range(4))
    client.prefetch(KEYS[:1], [0])  # now it may be filled


async def test_cancelling_a_ticket_does_not_free_its_pages(scripted: Scripted) -> None:
    await scripted.open()
    prefetch = scripted.client.prefetch(KEYS[:1], [3])
    prefetch.cancel()
    assert scripted.client.busy(3)  # the actor may be writing it right now
    await scripted.outbox.send(Done(await scripted.next_ticket(), 1))
    await asyncio.sleep(0.01)
    assert not scripted.client.busy(3)


async def test_an_invalid_ticket_fails_alone(scripted: Scripted) -> None:
    await scripted.open()
    with pytest.raises(ValueError, match="2 keys for 1 host pages"):
        scripted.client.backup(KEYS[:2], [0])
    with pytest.raises(ValueError, match="twice"):
        scripted.client.backup(KEYS[:2], [0, 0])
    backup = scripted.client.backup(KEYS[:1], [0])
    await scripted.outbox.send(Done(await scripted.next_ticket(), 0, "host pages out of range"))
    with pytest.raises(TicketRefused, match="out of range"):
        await asyncio.wait_for(backup, PATIENCE_S)
    assert scripted.client.alive


async def test_the_actor_going_down_fails_pending_tickets_and_later_calls(
    scripted: Scripted, caplog: pytest.LogCaptureFixture
) -> None:
    await scripted.open()
    prefetch = scripted.client.prefetch(KEYS, [0, 1, 2])
    backup = scripted.client.backup(KEYS[:1], [3])  # never awaited: no warning about it
    with caplog.at_level(logging.ERROR):
        await scripted.outbox.send(Error(None, "the host-cache actor stopped", actor="hicache"))
        with pytest.raises(HiCacheUnavailable, match=DIED):
            await asyncio.wait_for(prefetch, PATIENCE_S)
    assert backup.done()
    assert "the engine continues with HiCache disabled" in caplog.text
    assert not scripted.client.alive and scripted.client.pending == 0
    assert not scripted.client.busy(0)  # a dead actor touches no page
    assert scripted.deaths == [DIED]
    for call in (scripted.client.prefetch, scripted.client.backup):
        with pytest.raises(HiCacheUnavailable, match=DIED):
            call(KEYS[:1], [0])
    await asyncio.wait_for(scripted.client.close(), PATIENCE_S)


async def test_an_unanswered_open_disables_hicache_after_the_timeout(scripted: Scripted) -> None:
    with pytest.raises(HiCacheUnavailable, match=DIED):
        await scripted.client.open(64, 4, timeout=0.05)
    assert not scripted.client.alive


async def test_close_fails_what_is_still_pending(scripted: Scripted) -> None:
    await scripted.open()
    prefetch = scripted.client.prefetch(KEYS[:1], [0])
    await scripted.client.close(drain_s=0.01)
    with pytest.raises(HiCacheUnavailable, match="shut down"):
        await prefetch
    assert not scripted.client.alive and scripted.deaths == []


async def test_the_exit_of_the_actors_process_is_noticed(scripted: Scripted) -> None:
    sleeper = await asyncio.create_subprocess_exec("sleep", "30")
    await scripted.open(pid=sleeper.pid)
    prefetch = scripted.client.prefetch(KEYS[:1], [0])
    sleeper.kill()
    with pytest.raises(HiCacheUnavailable, match=DIED):
        await asyncio.wait_for(prefetch, PATIENCE_S)
    await sleeper.wait()
