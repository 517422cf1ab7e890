"""`AsyncEngine`: the engine inside a running event loop (what the API server holds).

It starts the actor graph (`launch.py`) — as processes talking over ZeroMQ, or with
`single_process=True` as tasks in the current loop — sends each request to the tokenizer worker
that owns it and routes the returning `RequestOutput`s into per-request streams. A dead engine
process (or a crashed actor) fails every pending request with `EngineDeadError` and sets
`died`; a dead tokenizer worker fails only its own requests and is started again
(`workers.py`). `stop_admitting` and `drain` are the graceful shutdown: new requests are refused,
running ones get a deadline. `metrics` is the engine's Prometheus metrics, readable in this
process whichever way the actors run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3serve.engine.launch import ActorGraph, start_in_process, start_processes
from m3serve.engine.workers import TokenizerWorkers, worker_index
from m3serve.runtime.actor import Actor
from m3serve.runtime.config import ConfigInvalid, ServerArgs
from m3serve.runtime.messages import Abort, Error, GenerateReq, Ready, RequestOutput, TextBatch
from m3serve.runtime.orphans import new_run_dir, remove_orphans
from m3serve.runtime.shm import new_session_id
from m3serve.runtime.supervisor import Supervisor
from m3serve.runtime.transport import Inbox, MailboxClosed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine (or one of its actors) is gone; no request can complete."""


class RequestError(RuntimeError):
    """The engine refused or failed one request (code: the HTTP status it maps to)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Stream:
    worker: int  # the tokenizer worker that tokenizes and detokenizes the request
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False


class AsyncEngine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.info: dict[str, Any] = {}
        self.healthy = False
        self.dead: EngineDeadError | None = None
        self.died = asyncio.Event()  # set once the engine is dead (not by a shutdown)
        self.closing: str | None = None  # why new requests are refused (graceful shutdown)
        self.model_path: Path | None = None
        self.workers: TokenizerWorkers | None = None
        self._streams: dict[str, _Stream] = {}
        self._graph: ActorGraph | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._restart_timers: dict[int, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from m3serve.backends import check_backend
        from m3serve.model.build import resolve_device
        from m3serve.model.config import load_model_config
        from m3serve.model.locate import resolve_model_path
        from m3serve.model.tiny.default import default_model_path

        # Fail in this process, with the component's own message, before spawning anything.
        self.args.check_supported()
        path = self.args.model.model_path
        if path:
            self.model_path = resolve_model_path(path, self.args.model.revision)
        else:
            self.model_path = await asyncio.to_thread(default_model_path)
        config = load_model_config(self.model_path)
        page_size = self.args.cache.page_size
        if page_size is not None and page_size != config.text.page_size:
            raise ConfigInvalid(
                f"--page-size {page_size}: this model's KV page is its sparse block, "
                f"{config.text.page_size} tokens"
            )
        device = resolve_device(self.args.backend.device)
        moe_runner = self.args.kernel.moe_runner_backend
        backend = check_backend(self.args.backend.backend, device, moe_runner)
        if self.args.cache.kv_cache_dtype == "fp8_e4m3" and backend != "hopper":
            raise ConfigInvalid("--kv-cache-dtype fp8_e4m3 needs the hopper backend")
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

    @property
    def unavailable(self) -> str | None:
        """Why the engine takes no new request now; None when it does."""
        if self.dead is not None:
            return str(self.dead)
        if not self.healthy:
            return "not running"
        if self.closing is not None:
            return self.closing
        if self.workers is not None and not self.workers.any_live:
            return "no tokenizer worker is running (one is restarting after a crash)"
        return None

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

    # ------------------------------------------------------------------ requests

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they arrive; closing the iterator early
        aborts it."""
        if self.dead is not None:
            raise self.dead
        if not self.healthy or self.workers is None:
            raise EngineDeadError("the engine is not running")
        if self.closing is not None:
            raise RequestError(self.closing, 503)
        if req.rid in self._streams:
            raise RequestError(f"request id {req.rid!r} is already in use")
        worker = self.workers.route(req.rid)
        if worker is None:
            raise RequestError(str(self.unavailable), 503)
        state = _Stream(worker)
        self._streams[req.rid] = state
        try:
            await self.workers.outboxes[worker].send(req)
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    state.done = True
                    raise item
                if item.finish is not None:
                    state.done = True
                yield item
                if state.done:
                    return
        finally:
            self._streams.pop(req.rid, None)
            if not state.done:
                await self._abort(req.rid, state.worker)

    async def abort(self, rid: str) -> None:
        state = self._streams.get(rid)
        if state is not None:
            await self._abort(rid, state.worker)
        elif self.workers is not None:
            await self._abort(rid, self.workers.route(rid))

    async def _abort(self, rid: str, worker: int | None) -> None:
        if not self.healthy or self._graph is None or self.workers is None:
            return
        if worker is None or worker in self.workers.down:
            # Its worker is gone: tell the scheduler itself, so the request stops running.
            await self._graph.scheduler.send(Abort(rid))
        else:
            await self.workers.outboxes[worker].send(Abort(rid))

    async def _read(self, inbox: Inbox) -> None:
        """Route what the actors send back (outputs, request errors, crash reports)."""
        while True:
            try:
                message = await inbox.recv()
            except MailboxClosed:
                return
            if isinstance(message, TextBatch):
                self._deliver(message)
            elif isinstance(message, Error):
                self._deliver_error(message)
            elif isinstance(message, Ready):
                self._on_ready(message)

    def _deliver(self, batch: TextBatch) -> None:
        for output in batch.outputs:
            state = self._streams.get(output.rid)
            if state is not None:
                state.queue.put_nowait(output)

    def _deliver_error(self, error: Error) -> None:
        if error.rid is None:
            if self._restartable(error.actor):
                # Its process exits next; the supervisor's notice of that starts it again.
                log.error("%s", error.message)
            else:
                self._die(EngineDeadError(error.message))
            return
        state = self._streams.get(error.rid)
        if state is not None:
            state.queue.put_nowait(RequestError(error.message, error.code))

    def _on_death(self, name: str, exitcode: int | None) -> None:
        message = f"the {name} process exited unexpectedly (exit code {exitcode})"
        worker = worker_index(name)
        if worker is not None and self._restartable(name):
            self._restart_worker(worker, name, message)
            return
        if self._graph is not None:
            self._graph.forget_metrics_of(name)
        self._die(EngineDeadError(message))

    def _restartable(self, actor: str | None) -> bool:
        """A tokenizer worker in its own process can be started again; the engine cannot (its
        requests' KV and state are gone with it), nor can an in-process actor."""
        return (
            actor is not None
            and worker_index(actor) is not None
            and not self.args.runtime.single_process
        )

    def _restart_worker(self, worker: int, name: str, message: str) -> None:
        """Fail the dead worker's requests (their detokenizer state died with it), tell the
        scheduler to stop them, and start the worker again."""
        assert self._graph is not None and self.workers is not None
        log.error("%s", message)
        may_restart = self.workers.died(worker)
        lost = [rid for rid, state in self._streams.items() if state.worker == worker]
        for rid in lost:
            self._streams[rid].queue.put_nowait(
                RequestError(f"{message}; the request was lost, send it again", 503)
            )
        if lost:
            self._tasks.append(asyncio.create_task(self._abort_lost(lost)))
        if not may_restart:
            self._die(EngineDeadError(f"{message}; tokenizer workers keep dying, not restarted"))
            return
        self._graph.supervisor.respawn(name)
        timeout = self.args.runtime.startup_timeout
        old = self._restart_timers.pop(worker, None)
        if old is not None:
            old.cancel()
        self._restart_timers[worker] = asyncio.get_running_loop().call_later(
            timeout, self._restart_timed_out, worker, timeout
        )

    async def _abort_lost(self, rids: list[str]) -> None:
        assert self._graph is not None
        for rid in rids:
            await self._graph.scheduler.send(Abort(rid))

    def _restart_timed_out(self, worker: int, timeout: float) -> None:
        assert self.workers is not None
        if worker in self.workers.down:
            self._die(
                EngineDeadError(f"tokenizer{worker} was not ready {timeout:g}s after a restart")
            )

    def _on_ready(self, ready: Ready) -> None:
        worker = worker_index(ready.actor)
        if worker is None or self.workers is None or not self.workers.ready(worker):
            return
        timer = self._restart_timers.pop(worker, None)
        if timer is not None:
            timer.cancel()
        log.info("tokenizer%d is serving again (pid %d)", worker, ready.pid)

    def _die(self, error: EngineDeadError) -> None:
        if self.dead is None:
            log.error("%s", error)
            self.dead = error
        self.healthy = False
        self.died.set()
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in self._streams.values():
            state.queue.put_nowait(error)
