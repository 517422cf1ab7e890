"""The tokenizer workers as the API process sees them: which one a request goes to, which are
down, and whether a dead one may be started again.

A request goes to a live worker chosen by its rid (`crc32(rid) % live`), and stays with that
worker for its whole life, since the worker that tokenized it also detokenizes its output. A
dead worker is skipped until its replacement reports ready, so with two or more workers no new
request waits for a restart. Workers that keep dying (more than `MAX_RESTARTS` deaths within
`RESTART_WINDOW_S`) are not started again: something breaks every start, and the caller treats
the engine as dead instead.
"""

from __future__ import annotations

import re
import time
import zlib

from m3serve.runtime.transport import Outbox

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0

_NAME = re.compile(r"tokenizer([0-9]+)")


def worker_index(name: str) -> int | None:
    """The index of the tokenizer worker named `tokenizer<i>` (a process or an actor); None for
    any other name."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


class TokenizerWorkers:
    def __init__(self, outboxes: list[Outbox]) -> None:
        self.outboxes = outboxes
        self.down: set[int] = set()
        self._deaths: list[float] = []

    @property
    def any_live(self) -> bool:
        return len(self.down) < len(self.outboxes)

    def route(self, rid: str) -> int | None:
        """The live worker that takes request `rid` (None while every worker is down)."""
        live = [i for i in range(len(self.outboxes)) if i not in self.down]
        if not live:
            return None
        return live[zlib.crc32(rid.encode()) % len(live)]

    def died(self, worker: int) -> bool:
        """Mark `worker` down; returns whether it may be started again."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S]
        self._deaths.append(now)
        self.down.add(worker)
        return len(self._deaths) <= MAX_RESTARTS

    def ready(self, worker: int) -> bool:
        """Mark `worker` live again; returns whether it had been down."""
        if worker not in self.down:
            return False
        self.down.discard(worker)
        return True
