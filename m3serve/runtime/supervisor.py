"""Spawning actor processes, waiting for them to be ready, noticing when one dies, starting a
dead one again, and shutting everything down so that no child process, socket file or
shared-memory segment is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from m3serve.runtime.messages import Error, Ready
from m3serve.runtime.shm import remove_session_segments
from m3serve.runtime.transport import Inbox

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """Children start with SIGINT ignored (an ignored signal stays ignored across exec, and
    Python then installs no KeyboardInterrupt handler): a terminal's Ctrl-C reaches the whole
    process group, and a child still importing must not die of it with a traceback; the parent
    stops its children itself. Only the main thread may change a signal's handler; a child
    spawned from another thread ignores SIGINT from its entry point on (launch.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StartupError(RuntimeError):
    """An actor did not become ready; the message names it and says why."""


class Supervisor:
    def __init__(self, session: str, run_dir: Path) -> None:
        self.session = session
        self.run_dir = run_dir
        self.procs: dict[str, BaseProcess] = {}
        self._context = mp.get_context("spawn")
        self._specs: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {}
        self._watched: dict[str, int] = {}  # name -> sentinel fd the loop watches
        self._on_death: Callable[[str, int | None], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        proc = self._context.Process(target=target, args=args, name=f"m3serve-{name}")
        with _ctrl_c_ignored():
            proc.start()
        self.procs[name] = proc
        self._specs[name] = (target, args)
        log.info("started %s (pid %d)", name, proc.pid)

    def respawn(self, name: str) -> None:
        """Start a dead child again, as it was first started; it is watched like the first."""
        target, args = self._specs[name]
        self.spawn(name, target, *args)
        if self._on_death is not None:
            self._watch(name)

    async def wait_ready(self, control: Inbox, timeout: float) -> dict[str, Ready]:
        """Collect one Ready per spawned process; fail fast on an Error or a dead child."""
        ready: dict[str, Ready] = {}
        deadline = time.monotonic() + timeout
        # One receive lives across the polls: asyncio.wait never cancels what it waits on.
        # Cancelling the receive at each poll's timeout (asyncio.wait_for) can drop a message
        # the socket has already handed to it, when both fall due in one loop iteration; a
        # lost Ready leaves the server starting forever.
        receive: asyncio.Future[Any] | None = None
        try:
            while len(ready) < len(self.procs):
                self._raise_if_dead(ready)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(self.procs) - set(ready))
                    raise StartupError(f"not ready after {timeout:.0f}s: {', '.join(missing)}")
                if receive is None:
                    receive = asyncio.ensure_future(control.recv())
                done, _ = await asyncio.wait({receive}, timeout=min(remaining, 0.5))
                if not done:
                    continue
                message, receive = receive.result(), None
                if isinstance(message, Error):
                    raise StartupError(message.message)
                if isinstance(message, Ready):
                    ready[message.actor] = message
        finally:
            if receive is not None:
                receive.cancel()
        return ready

    def _raise_if_dead(self, ready: dict[str, Ready]) -> None:
        for name, proc in self.procs.items():
            if name not in ready and proc.exitcode is not None:
                raise StartupError(f"{name} exited with code {proc.exitcode} during start-up")

    def watch(self, on_death: Callable[[str, int | None], None]) -> None:
        """Call on_death(name, exitcode) from the event loop as soon as a child exits."""
        self._loop = asyncio.get_running_loop()
        self._on_death = on_death
        for name in self.procs:
            self._watch(name)

    def _watch(self, name: str) -> None:
        assert self._loop is not None
        sentinel = self.procs[name].sentinel
        self._loop.add_reader(sentinel, self._reap, name)
        self._watched[name] = sentinel

    def _reap(self, name: str) -> None:
        proc = self.procs[name]
        assert self._loop is not None and self._on_death is not None
        self._loop.remove_reader(self._watched.pop(name))
        proc.join(timeout=1)
        self._on_death(name, proc.exitcode)

    def stop_watching(self) -> None:
        """From now on a child's exit is expected (shutdown): no more on_death calls."""
        if self._loop is not None:
            for fd in self._watched.values():
                self._loop.remove_reader(fd)
        self._watched.clear()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Wait for the children to exit on their own, then terminate, then kill."""
        self.stop_watching()
        await asyncio.to_thread(self._stop_all, timeout)
        self.cleanup()

    def _stop_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(timeout=max(deadline - time.monotonic(), 0))
        for action in ("terminate", "kill"):
            alive = [p for p in self.procs.values() if p.is_alive()]
            for proc in alive:
                log.warning("%s of %s (pid %s)", action, proc.name, proc.pid)
                getattr(proc, action)()
            for proc in alive:
                proc.join(timeout=5)

    def cleanup(self) -> None:
        """Remove the run directory (socket files) and the session's shared memory."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        removed = remove_session_segments(self.session)
        if removed:
            log.info("removed %d leftover shared-memory segment(s)", removed)
