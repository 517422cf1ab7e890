"""Mailboxes: one send/recv interface over in-process queues and ZeroMQ `ipc://` sockets.

An actor receives from one `Inbox` and sends through `Outbox`es; whether a peer shares its
process decides only which kind it is handed.

- `InProcChannel`: an asyncio.Queue; messages pass as objects, without encoding. Its mailboxes
  belong to actors that share one event loop (asyncio.Queue is neither thread- nor loop-safe).
- `ZmqInbox` binds a PULL socket; any number of `ZmqOutbox` (asyncio) or `SyncZmqOutbox` (plain,
  for threads without a loop) PUSH sockets connect to it. Messages go through a `Codec`, arrays
  as zero-copy frames.

Ownership: a sent message (and every array in it) belongs to the receiver; the sender must not
modify it afterwards. Closing: after `close()`, `send`/`recv` raise `MailboxClosed`, and a `recv`
waiting at that moment raises it too. Sockets close with LINGER 0, so an outbox closed right
after a send may drop what the peer has not taken yet.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import zmq
import zmq.asyncio

from m3serve.runtime.codec import Codec

M = TypeVar("M")
M_contra = TypeVar("M_contra", contravariant=True)
M_co = TypeVar("M_co", covariant=True)

# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_IPC_PATH = 107


class MailboxClosed(Exception):
    """The mailbox was closed: no more sends or receives through it."""


class Outbox(Protocol[M_contra]):
    async def send(self, msg: M_contra) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


class Inbox(Protocol[M_co]):
    async def recv(self) -> M_co: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


# ---------------------------------------------------------------- in-process


class _Closed:
    """Queued by `close()` to wake a `recv` that is waiting on an empty queue."""


_CLOSED = _Closed()


class _InProcInbox(Generic[M]):
    def __init__(self, queue: asyncio.Queue[M | _Closed]) -> None:
        self._queue = queue
        self.closed = False

    async def recv(self) -> M:
        if self.closed:
            raise MailboxClosed("inbox is closed")
        msg = await self._queue.get()
        if isinstance(msg, _Closed):
            self._queue.put_nowait(msg)  # wake the next waiting recv as well, if any
            raise MailboxClosed("inbox is closed")
        return msg

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Drop what nobody will read, which also frees room for the wake-up marker.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_CLOSED)


class _InProcOutbox(Generic[M]):
    def __init__(self, queue: asyncio.Queue[M | _Closed], inbox: _InProcInbox[M]) -> None:
        self._queue = queue
        self._inbox = inbox
        self.closed = False

    async def send(self, msg: M) -> None:
        if self.closed or self._inbox.closed:
            raise MailboxClosed("outbox is closed" if self.closed else "receiver is closed")
        await self._queue.put(msg)

    def close(self) -> None:
        self.closed = True


class InProcChannel(Generic[M]):
    """One receiver fed by any number of outboxes, over one asyncio.Queue on one event loop.

    `maxsize` > 0 bounds the queue, so a fast sender waits for a slow receiver.
    """

    def __init__(self, maxsize: int = 0) -> None:
        self._queue: asyncio.Queue[M | _Closed] = asyncio.Queue(maxsize)
        self._inbox: _InProcInbox[M] = _InProcInbox(self._queue)

    def outbox(self) -> Outbox[M]:
        """A new sending end; each sender takes its own."""
        return _InProcOutbox(self._queue, self._inbox)

    def inbox(self) -> Inbox[M]:
        """The channel's single receiving end (the same object on every call)."""
        return self._inbox


# ---------------------------------------------------------------- ZeroMQ


def ipc_address(run_dir: Path, name: str) -> str:
    """The `ipc://` address of mailbox `name` under `run_dir` (a socket file `<name>.sock`)."""
    path = Path(run_dir) / f"{name}.sock"
    if len(str(path).encode()) > _MAX_IPC_PATH:
        raise ValueError(f"ipc socket path longer than {_MAX_IPC_PATH} bytes: {path}")
    return f"ipc://{path}"


def _configure(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unlimited queues: a full queue would make PUSH block (or drop), and an Abort or Shutdown
    # must always get through; memory is bounded by the scheduler's own admission instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _remove_ipc_file(address: str) -> None:
    # libzmq leaves the socket file of a closed bound socket behind; remove it ourselves.
    # ("ipc://@name" is Linux's abstract namespace: no file.)
    path = address.removeprefix("ipc://")
    if path != address and not path.startswith("@"):
        Path(path).unlink(missing_ok=True)


class ZmqInbox(Generic[M]):
    """Binds a PULL socket at `address` and decodes what arrives with `codec`."""

    def __init__(
        self, address: str, codec: Codec[M], ctx: zmq.asyncio.Context | None = None
    ) -> None:
        self.address = address
        self._codec = codec
        self._sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PULL)
        _configure(self._sock)
        self._sock.bind(address)

    async def recv(self) -> M:
        if self._sock.closed:
            raise MailboxClosed(f"inbox {self.address} is closed")
        try:
            frames = await self._sock.recv_multipart(copy=False)
        except asyncio.CancelledError:
            # Closing the socket cancels a waiting receive; report it as what happened.
            if self._sock.closed:
                raise MailboxClosed(f"inbox {self.address} is closed") from None
            raise
        return self._codec.decode([frame.buffer for frame in frames])

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            _remove_ipc_file(self.address)


class ZmqOutbox(Generic[M]):
    """Connects a PUSH socket to the inbox at `address` (asyncio); the inbox may bind later."""

    def __init__(
        self, address: str, codec: Codec[M], ctx: zmq.asyncio.Context | None = None
    ) -> None:
        self.address = address
        self._codec = codec
        self._sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PUSH)
        _configure(self._sock)
        self._sock.connect(address)

    async def send(self, msg: M) -> None:
        if self._sock.closed:
            raise MailboxClosed(f"outbox to {self.address} is closed")
        # copy=False: large frames (array views) go to libzmq without a copy.
        await self._sock.send_multipart(self._codec.encode(msg), copy=False)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def close(self) -> None:
        self._sock.close(linger=0)


class SyncZmqOutbox(Generic[M]):
    """A `ZmqOutbox` on a plain (blocking) socket, for code without an event loop, such as a
    supervisor thread. Like every zmq socket, use it from one thread only."""

    def __init__(self, address: str, codec: Codec[M], ctx: zmq.Context[Any] | None = None) -> None:
        self.address = address
        self._codec = codec
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        _configure(self._sock)
        self._sock.connect(address)

    def send_nowait(self, msg: M) -> None:
        """Queue `msg` for sending; never waits, since the send queue is unbounded."""
        if self._sock.closed:
            raise MailboxClosed(f"outbox to {self.address} is closed")
        self._sock.send_multipart(self._codec.encode(msg), copy=False)

    async def send(self, msg: M) -> None:
        self.send_nowait(msg)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def close(self) -> None:
        self._sock.close(linger=0)
