"""`AsyncEngine`: the engine inside a running event loop (what the API server holds, and the
library's async surface).

    engine = await AsyncEngine.create(model_path=None, single_process=False, ...)
    out = await engine.generate("The capital of France is", {"max_new_tokens": 16})
    async for chunk in engine.generate_stream("Stream me", max_new_tokens=8): ...
    answer = await engine.chat([{"role": "user", "content": "hi"}], tools=None, temperature=0)
    await engine.close()

It starts the actor graph (`launch.py`) — as processes talking over ZeroMQ, or with
`single_process=True` as tasks in the current loop — sends each request to the tokenizer worker
that owns it and routes the returning `RequestOutput`s into per-request streams; `tokenize` and
`detokenize` are one-message round trips to a worker. Starting and closing never block the loop
with the processes' start-up and exit (the checks and imports before the start run off the
loop); single-process, the model itself loads in the loop. A dead engine process (or a crashed
actor) fails every pending request with `EngineDeadError` and sets `died`; a dead tokenizer
worker fails only its own requests and is started again (`workers.py`). `stop_admitting` and
`drain` are the graceful shutdown: new requests are refused, running ones get a deadline.
`metrics` is the engine's Prometheus metrics, readable in this
process whichever way the actors run.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from m3serve.engine.checks import checked_off_the_loop
from m3serve.engine.errors import EngineDeadError, RequestError
from m3serve.engine.launch import start_in_process, start_processes
from m3serve.engine.library_calls import LibraryCalls
from m3serve.engine.workers import TokenizerWorkers
from m3serve.runtime.actor import Actor
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.orphans import new_run_dir, remove_orphans
from m3serve.runtime.shm import new_session_id
from m3serve.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

DRAIN_POLL_S = 0.05


__all__ = ["AsyncEngine", "EngineDeadError", "RequestError"]


class AsyncEngine(LibraryCalls):
    """The engine's lifecycle: start the actor graph, report on it, drain and shut it down; the
    requests (`plumbing.py`), failures (`recovery.py`) and library calls (`library_calls.py`)
    are the bases'."""

    @classmethod
    async def create(cls, model_path: str | None = None, **server_args: Any) -> AsyncEngine:
        """A started engine: `server_args` are the CLI flags as keywords (`single_process`,
        `max_total_tokens`, ...); no model_path means the built-in tiny checkpoint."""
        engine = cls(ServerArgs.from_kwargs(model_path=model_path, **server_args))
        await engine.start()
        return engine

    async def start(self) -> None:
        self.model_path = await checked_off_the_loop(self.args)
        remove_orphans()  # what servers killed with SIGKILL left behind
        session = new_session_id()
        supervisor = Supervisor(session, new_run_dir(session))
        launch = start_in_process if self.args.runtime.single_process else start_processes
        try:
            self._graph = await launch(self.args, self.model_path, supervisor)
        except BaseException:
            await supervisor.shutdown()
            raise
        graph = self._graph
        self.workers = TokenizerWorkers(graph.tokenizers)
        supervisor.watch(self._on_death)
        self._tasks = [
            asyncio.create_task(self._read(graph.outputs), name="engine-outputs"),
            asyncio.create_task(self._read(graph.control), name="engine-control"),
        ]
        for message in graph.ready.values():
            self.info.update(message.info)
        self.info["model_path"] = str(self.model_path)
        self.healthy = True

    async def shutdown(self) -> None:
        self.healthy = False
        for timer in self._restart_timers.values():
            timer.cancel()
        if self._graph is not None:
            await self._graph.shutdown()
            self._graph = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all(EngineDeadError("the engine was shut down"))

    async def close(self) -> None:
        """Shut down: the actors stop and their processes are waited for off the loop."""
        await self.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stop_admitting(self, reason: str) -> None:
        """Refuse every new request from now on (a 503 giving `reason`); running ones go on."""
        self.closing = reason

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the running requests to finish, then fail the rest
        (a 503, in-band for a stream); returns how many were cut off."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        cut = len(self._streams)
        if cut:
            reason = self.closing or "the server is shutting down"
            message = f"{reason}: the request did not finish within {timeout:g}s"
            self._fail_all(RequestError(message, 503))
        return cut

    @property
    def actors(self) -> list[Actor]:
        """The actors of a single-process engine (empty when they run as processes)."""
        return self._graph.actors if self._graph is not None else []

    @property
    def metrics(self) -> CollectorRegistry | None:
        """The engine's Prometheus metrics (running and waiting requests, KV and prefix-cache
        use, retractions) as a registry to collect or render next to your own; None while the
        engine is not running. With actor processes it reads the files the engine process
        writes (prometheus_client's multiprocess mode); single-process, it is the scheduler's
        own registry."""
        return self._graph.metrics if self._graph is not None else None

    @property
    def supervisor(self) -> Supervisor | None:
        return self._graph.supervisor if self._graph is not None else None

    @property
    def processes(self) -> dict[str, int]:
        """Actor process name -> pid (empty in single-process mode)."""
        if self._graph is None:
            return {}
        procs = self._graph.supervisor.procs
        return {name: proc.pid for name, proc in procs.items() if proc.pid}
