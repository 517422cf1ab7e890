"""A dependency-free progress line for long loads (a bar on a terminal, sparse lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

QUIET_SECONDS = 2.0


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_decile = -1

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
        elif int(fraction * 10) > self._last_decile and self._elapsed() >= QUIET_SECONDS:
            # Logs get one line per 10% of a long load, not carriage returns or noise.
            self._last_decile = int(fraction * 10)
            self.stream.write(f"{self.label}: {fraction:.0%} ({self._eta()})\n")

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _eta(self) -> str:
        elapsed = self._elapsed()
        if self.done == self.total:
            return f"{elapsed:.1f}s"
        remaining = elapsed / max(self.done, 1) * (self.total - self.done)
        return f"{elapsed:.0f}s elapsed, ~{remaining:.0f}s left"
