"""`Supervisor.wait_ready`: every Ready is collected, however long the children take."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from m3serve.runtime.messages import Ready
from m3serve.runtime.supervisor import StartupError, Supervisor


class SocketLikeInbox:
    """Receives as a socket does: a message is taken off the queue as soon as a receive is
    waiting, so a receive cancelled after that loses it. Counts the receives cancelled."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = 0

    async def recv(self) -> Any:
        try:
            message = await self.queue.get()
            await asyncio.sleep(0)  # the hand-over: a cancel landing here drops the message
            return message
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def _supervisor(tmp_path: Any, *names: str) -> Supervisor:
    supervisor = Supervisor("test", tmp_path)
    supervisor.procs = {name: SimpleNamespace(exitcode=None) for name in names}  # type: ignore[misc]
    return supervisor


async def test_waiting_across_polls_never_cancels_a_receive(tmp_path: Any) -> None:
    """The engine's Ready comes after several 0.5 s polls; no receive is cancelled on the way
    (a cancelled one can lose a Ready that arrives as a poll times out)."""
    supervisor = _supervisor(tmp_path, "engine", "tokenizer0")
    inbox = SocketLikeInbox()
    inbox.queue.put_nowait(Ready("tokenizer0", 2, {}))
    loop = asyncio.get_running_loop()
    loop.call_later(1.2, inbox.queue.put_nowait, Ready("engine", 1, {"page_size": 128}))
    ready = await supervisor.wait_ready(inbox, timeout=10)  # type: ignore[arg-type]
    assert sorted(ready) == ["engine", "tokenizer0"]
    assert ready["engine"].info == {"page_size": 128}
    assert inbox.cancelled == 0


async def test_the_pending_receive_is_dropped_when_start_up_fails(tmp_path: Any) -> None:
    supervisor = _supervisor(tmp_path, "engine")
    inbox = SocketLikeInbox()
    with pytest.raises(StartupError, match="not ready after 1s: engine"):
        await supervisor.wait_ready(inbox, timeout=0.8)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert inbox.cancelled == 1  # the one receive, at the end
