"""Copy orders between the device and host tiers, and which of them are still in flight.

The tiered prefix cache decides copies on the scheduler's thread; they run later, in order with
the engine's steps, on the executor thread (a backup as its own job, a load-back layer by layer
inside the forward of the step that carries it). A `Ticket` is one such order: its pages on both
tiers, settled by whoever ran it with a `Completion` (done at once on CPU, a CUDA event on a
GPU). Until a ticket is done, none of its pages may be freed on either tier: the cache waits on a
node's ticket before it frees that node's pages, and `CopyTracker.in_flight` lets `check()` prove
that no in-flight page is free.

Order is what makes reads safe: every copy and every step runs in submission order (one executor
thread, one copy stream), so a load-back from host pages whose backup is still in flight reads
them after the backup wrote them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Literal, Protocol

Kind = Literal["backup", "load"]


class Completion(Protocol):
    """A copy that was issued: finished yet, and a way to wait for it."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Finished:
    """A copy that ran synchronously (CPU)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


FINISHED = Finished()


class Ticket:
    """One copy order: `device[i]` <-> `host[i]`, in the direction of `kind`."""

    def __init__(self, op: int, kind: Kind, device: list[int], host: list[int]) -> None:
        if len(device) != len(host):
            raise ValueError(f"{len(device)} device pages vs {len(host)} host pages")
        self.op = op
        self.kind = kind
        self.device = device
        self.host = host
        self.sent = kind == "backup"  # a load is sent with the step plan that runs it
        self.before_wait: Callable[[Ticket], None] | None = None  # tests: run the queue up to it
        self._issued = threading.Event()
        self._completion: Completion = FINISHED

    def settle(self, completion: Completion = FINISHED) -> None:
        """The copy was issued (or failed: its pages are then free to go all the same)."""
        self._completion = completion
        self._issued.set()

    @property
    def issued(self) -> bool:
        return self._issued.is_set()

    def done(self) -> bool:
        return self._issued.is_set() and self._completion.done()

    def wait(self) -> None:
        if not self._issued.is_set():
            if not self.sent:
                raise RuntimeError(f"copy {self.op} waited on before any step carries it")
            if self.before_wait is not None:
                self.before_wait(self)
        self._issued.wait()
        self._completion.wait()


class CopyTracker:
    """Every ticket not yet reaped. Backups go to `submit` as they are made; loads wait in
    `unsent` for the next step plan, which carries them to the forward that runs them."""

    def __init__(
        self,
        submit: Callable[[Ticket], None] | None = None,
        before_wait: Callable[[Ticket], None] | None = None,
    ) -> None:
        self.submit = submit  # set by the engine core: queue a backup behind the steps so far
        self.before_wait = before_wait
        self._ops = itertools.count(1)
        self._tickets: dict[int, Ticket] = {}
        self._unsent: list[Ticket] = []

    def backup(self, device: list[int], host: list[int]) -> Ticket:
        ticket = self._add("backup", device, host)
        if self.submit is None:
            ticket.settle()  # no device to copy from (scheduler-only tests)
        else:
            self.submit(ticket)
        return ticket

    def load(self, device: list[int], host: list[int]) -> Ticket:
        ticket = self._add("load", device, host)
        self._unsent.append(ticket)
        return ticket

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def take_unsent(self) -> list[Ticket]:
        """The loads for the step being planned (it must run them: someone may wait on them)."""
        unsent, self._unsent = self._unsent, []
        for ticket in unsent:
            ticket.sent = True
        return unsent

    def get(self, op: int) -> Ticket:
        # Read from the executor thread; the dict only changes on the scheduler's thread, and a
        # ticket the executor has not settled cannot be reaped.
        return self._tickets[op]

    def reap(self) -> None:
        """Forget the tickets whose copies are finished."""
        for op in [op for op, ticket in self._tickets.items() if ticket.done()]:
            del self._tickets[op]

    def wait_all(self, issued_only: bool = False) -> None:
        """Wait for every copy (`issued_only`: those issued; at shutdown the rest never run)."""
        for ticket in list(self._tickets.values()):
            if ticket.issued or not issued_only:
                ticket.wait()
        self.reap()

    def in_flight(self) -> tuple[set[int], set[int]]:
        """Device and host pages of every copy not finished yet."""
        device: set[int] = set()
        host: set[int] = set()
        for ticket in self._tickets.values():
            if ticket.done():
                continue
            device.update(ticket.device)
            host.update(ticket.host)
        return device, host

    def _add(self, kind: Kind, device: list[int], host: list[int]) -> Ticket:
        ticket = Ticket(next(self._ops), kind, device, host)
        ticket.before_wait = self.before_wait
        self._tickets[ticket.op] = ticket
        return ticket
