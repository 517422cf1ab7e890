"""The actor base: an inbox, a type -> handler table, and a start/ready/stop lifecycle.

An actor never knows whether its peers live in the same process: it receives from one `Inbox`
and sends to `Outbox`es, which are in-process queues or ZeroMQ sockets behind one interface.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from m3serve.runtime.heap import freeze_heap
from m3serve.runtime.messages import Error, Ready, Shutdown
from m3serve.runtime.transport import Inbox, Outbox

log = logging.getLogger(__name__)

Handler = Callable[[Any, Any], Awaitable[None] | None]
F = TypeVar("F", bound=Callable[..., Any])


def handles(*message_types: type) -> Callable[[F], F]:
    """Mark a method as the handler of the given message types."""

    def mark(method: F) -> F:
        method.__handles__ = message_types  # type: ignore[attr-defined]
        return method

    return mark


class Actor:
    """Subclasses implement handlers with @handles and may override `on_start` / `on_stop`."""

    name = "actor"

    def __init__(self, inbox: Inbox, control: Outbox | None = None) -> None:
        self.inbox = inbox
        self.control = control
        self._handlers: dict[type, Handler] = {}
        for attr in dir(type(self)):
            method = getattr(type(self), attr)
            for message_type in getattr(method, "__handles__", ()):
                self._handlers[message_type] = method
        self.stopping = False

    async def on_start(self) -> dict[str, Any]:
        """Runs before the actor reports ready; returns facts to publish with `Ready`."""
        return {}

    async def on_stop(self) -> None:
        """Runs once after the loop ends (also after a crash), to release resources."""

    async def dispatch(self, message: Any) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            log.warning("%s: no handler for %s", self.name, type(message).__name__)
            return
        result = handler(self, message)
        if asyncio.iscoroutine(result):
            await result

    async def serve(self, own_process: bool = False) -> None:
        """Start, report ready, handle messages until Shutdown; report a crash before dying.
        `own_process`: the actor is its process's only tenant, whose start-up heap is then
        frozen before it reports ready (runtime/heap.py)."""
        try:
            info = await self.on_start()
            if own_process:
                freeze_heap(self.name)
            if self.control is not None:
                await self.control.send(Ready(self.name, os.getpid(), info))
            await self.loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("%s crashed", self.name)
            if self.control is not None:
                crash = Error(None, f"{self.name} crashed: {exc!r}", actor=self.name)
                await self.control.send(crash)
            raise
        finally:
            await self.on_stop()

    async def loop(self) -> None:
        """Receive and dispatch until Shutdown. Actors with their own rhythm override this."""
        while not self.stopping:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                break
            await self.dispatch(message)
