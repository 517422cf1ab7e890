"""Mailboxes deliver in order, from many senders, across processes, and clean up on close."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from m3serve.runtime.codec import Codec
from m3serve.runtime.messages import (
    Abort,
    GenerateReq,
    Shutdown,
    TokenBatch,
    TokenIds,
    ToTokenizer,
)
from m3serve.runtime.transport import (
    Inbox,
    InProcChannel,
    MailboxClosed,
    Outbox,
    SyncZmqOutbox,
    ZmqInbox,
    ZmqOutbox,
    ipc_address,
)

ROOT = Path(__file__).resolve().parents[3]
# Safety net only: a broken peer fails the test instead of hanging it.
PATIENCE_S = 30.0


def codec() -> Codec[ToTokenizer]:
    return Codec(ToTokenizer)


async def recv(inbox: Inbox[Any]) -> Any:
    return await asyncio.wait_for(inbox.recv(), PATIENCE_S)


async def send_aborts(outbox: Outbox[Any], sender: str, count: int) -> None:
    for i in range(count):
        await outbox.send(Abort(f"{sender}:{i}"))


def assert_each_senders_order(rids: list[str], senders: list[str], count: int) -> None:
    for sender in senders:
        mine = [rid for rid in rids if rid.startswith(f"{sender}:")]
        assert mine == [f"{sender}:{i}" for i in range(count)]


# ---------------------------------------------------------------- in-process


async def test_in_process_mailbox_delivers_the_same_objects_in_order() -> None:
    channel: InProcChannel[Abort] = InProcChannel()
    outbox, inbox = channel.outbox(), channel.inbox()
    sent = [Abort(f"r{i}") for i in range(100)]
    for msg in sent:
        await outbox.send(msg)
    got = [await recv(inbox) for _ in sent]
    assert all(a is b for a, b in zip(got, sent, strict=True))


async def test_several_in_process_outboxes_feed_one_inbox() -> None:
    channel: InProcChannel[Abort] = InProcChannel(maxsize=4)  # senders wait on the receiver
    senders = ["a", "b", "c"]
    tasks = [asyncio.create_task(send_aborts(channel.outbox(), s, 50)) for s in senders]
    rids = [(await recv(channel.inbox())).rid for _ in range(150)]
    await asyncio.gather(*tasks)
    assert_each_senders_order(rids, senders, 50)


async def test_closing_an_in_process_inbox_wakes_a_waiting_recv() -> None:
    channel: InProcChannel[Abort] = InProcChannel()
    inbox = channel.inbox()
    waiting = asyncio.create_task(inbox.recv())
    await asyncio.sleep(0)  # let it start waiting on the empty queue
    inbox.close()
    with pytest.raises(MailboxClosed):
        await waiting
    with pytest.raises(MailboxClosed):
        await channel.outbox().send(Abort("late"))


async def test_a_closed_in_process_outbox_refuses_to_send() -> None:
    channel: InProcChannel[Abort] = InProcChannel()
    outbox = channel.outbox()
    outbox.close()
    with pytest.raises(MailboxClosed):
        await outbox.send(Abort("r"))


# ---------------------------------------------------------------- ZeroMQ


async def test_zmq_mailbox_delivers_in_order(tmp_path: Path) -> None:
    address = ipc_address(tmp_path, "tok")
    inbox, outbox = ZmqInbox(address, codec()), ZmqOutbox(address, codec())
    try:
        await send_aborts(outbox, "a", 200)
        rids = [(await recv(inbox)).rid for _ in range(200)]
    finally:
        outbox.close()
        inbox.close()
    assert rids == [f"a:{i}" for i in range(200)]


async def test_several_zmq_senders_reach_one_receiver(tmp_path: Path) -> None:
    address = ipc_address(tmp_path, "tok")
    inbox = ZmqInbox(address, codec())
    outboxes = [ZmqOutbox(address, codec()) for _ in range(3)]
    from_thread = SyncZmqOutbox(address, codec())
    senders = ["a", "b", "c", "sync"]
    try:
        # The blocking outbox runs in a thread, as a supervisor would use it.
        thread = asyncio.to_thread(
            lambda: [from_thread.send_nowait(Abort(f"sync:{i}")) for i in range(50)]
        )
        await asyncio.gather(
            *(send_aborts(o, s, 50) for o, s in zip(outboxes, senders[:3], strict=True)), thread
        )
        rids = [(await recv(inbox)).rid for _ in range(200)]
    finally:
        for outbox in [*outboxes, from_thread]:
            outbox.close()
        inbox.close()
    assert_each_senders_order(rids, senders, 50)


async def test_an_outbox_may_connect_before_its_inbox_binds(tmp_path: Path) -> None:
    address = ipc_address(tmp_path, "late")
    outbox = ZmqOutbox(address, codec())
    await outbox.send(Abort("early"))
    inbox = ZmqInbox(address, codec())
    try:
        assert (await recv(inbox)).rid == "early"
    finally:
        outbox.close()
        inbox.close()


async def test_arrays_arrive_through_zmq_as_views_of_the_received_frame(tmp_path: Path) -> None:
    address = ipc_address(tmp_path, "tok")
    inbox, outbox = ZmqInbox(address, codec()), ZmqOutbox(address, codec())
    ids = np.arange(100_000, dtype=np.int32)
    try:
        await outbox.send(GenerateReq(rid="r", input_ids=TokenIds(ids.size, ids)))
        got = await recv(inbox)
    finally:
        outbox.close()
        inbox.close()
    assert isinstance(got, GenerateReq)
    assert got.input_ids is not None
    array = got.input_ids.array
    assert np.array_equal(array, ids)
    # No copy after receipt: the array's memory is the zmq message's own.
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview)
    assert isinstance(base.obj, zmq.Frame)


async def test_closing_zmq_mailboxes_closes_sockets_and_removes_the_ipc_file(
    tmp_path: Path,
) -> None:
    address = ipc_address(tmp_path, "tok")
    socket_file = tmp_path / "tok.sock"
    inbox, outbox = ZmqInbox(address, codec()), ZmqOutbox(address, codec())
    assert socket_file.exists()
    waiting = asyncio.create_task(inbox.recv())
    await asyncio.sleep(0)
    outbox.close()
    inbox.close()
    assert inbox.closed
    assert outbox.closed
    assert not socket_file.exists()
    with pytest.raises(MailboxClosed):
        await waiting
    with pytest.raises(MailboxClosed):
        await outbox.send(Abort("late"))


def test_ipc_addresses_longer_than_a_unix_socket_path_are_refused(tmp_path: Path) -> None:
    assert ipc_address(tmp_path, "api") == f"ipc://{tmp_path}/api.sock"
    with pytest.raises(ValueError, match="longer than"):
        ipc_address(tmp_path, "x" * 120)


# ---------------------------------------------------------------- across processes


def echo_until_shutdown(inbox_address: str, outbox_address: str) -> None:
    """Child process: send every message back until Shutdown."""

    async def run() -> None:
        inbox, outbox = ZmqInbox(inbox_address, codec()), ZmqOutbox(outbox_address, codec())
        try:
            while not isinstance(msg := await inbox.recv(), Shutdown):
                await outbox.send(msg)
        finally:
            outbox.close()
            inbox.close()

    asyncio.run(run())


async def test_messages_reach_another_process_and_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spawned child imports this module by name, which needs the repository root on its path.
    monkeypatch.syspath_prepend(str(ROOT))
    here, there = ipc_address(tmp_path, "here"), ipc_address(tmp_path, "there")
    inbox = ZmqInbox(here, codec())
    child = multiprocessing.get_context("spawn").Process(
        target=echo_until_shutdown, args=(there, here), daemon=True
    )
    child.start()
    outbox = ZmqOutbox(there, codec())
    ids = np.arange(50_000, dtype=np.int32)
    sent: list[Any] = [
        Abort("r0"),
        GenerateReq(rid="r1", prompt="hi", input_ids=TokenIds(ids.size, ids)),
        TokenBatch(rids=["r1"], new_ids=[[7]], finish=[None], cached_tokens=[0]),
    ]
    try:
        for msg in sent:
            await outbox.send(msg)
        got = [await recv(inbox) for _ in sent]
        await outbox.send(Shutdown())
        await asyncio.to_thread(child.join, PATIENCE_S)
        assert child.exitcode == 0
    finally:
        outbox.close()
        inbox.close()
        if child.is_alive():
            child.kill()
    assert [type(msg) for msg in got] == [type(msg) for msg in sent]
    assert got[0] == sent[0]
    assert got[2] == sent[2]
    assert np.array_equal(got[1].input_ids.array, ids)
    assert got[1].prompt == "hi"
