"""A dependency-free progress line for long loads: a bar on a terminal, sparse lines otherwise,
or lines in a log (a server's, where the load runs in a child process)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

QUIET_SECONDS = 2.0


class Progress:
    """With `log`, the load is logged at INFO: a line at the start, one per 10% once it has run
    QUIET_SECONDS, and one at the end; otherwise it is written to `stream` (stderr)."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        enabled: bool = True,
        log: logging.Logger | None = None,
    ):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.log = log
        self.tty = log is None and self.stream.isatty()
        self.started = time.monotonic()
        self._last_decile = -1
        if enabled and log is not None:
            log.info("%s: 0/%d", label, total)
            self._last_decile = 0  # the start line stands for 0-9%

    def advance(self, amount: int = 1) -> None:
        self.done = min(self.done + amount, self.total)
        if not self.enabled:
            return
        fraction = self.done / self.total
        if self.tty:
            bar = "#" * int(fraction * 30)
            self.stream.write(f"\r{self.label}: {fraction:4.0%} |{bar:<30}| {self._eta()}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
            return
        decile = int(fraction * 10)
        last = self.done == self.total and self.log is not None
        if decile > self._last_decile and (self._elapsed() >= QUIET_SECONDS or last):
            # Logs get one line per 10% of a long load, not carriage returns or noise.
            self._last_decile = decile
            self._line(f"{self.label}: {fraction:.0%} ({self._eta()})")

    def _line(self, text: str) -> None:
        if self.log is not None:
            self.log.info("%s", text)
        else:
            self.stream.write(text + "\n")

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _eta(self) -> str:
        elapsed = self._elapsed()
        if self.done == self.total:
            return f"{elapsed:.1f}s"
        remaining = elapsed / max(self.done, 1) * (self.total - self.done)
        return f"{elapsed:.0f}s elapsed, ~{remaining:.0f}s left"
