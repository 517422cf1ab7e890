"""The Engine facade: `AsyncEngine` (inside a running event loop, used by the API server) and
`Engine` (SGLang-style offline engine for library users, with sync and async methods).

`AsyncEngine` starts the actor graph — as processes talking over ZeroMQ, or with
`single_process=True` as tasks in the current loop over in-process mailboxes — sends requests to
the tokenizer worker that owns them and turns the returning `TextBatch`es into per-request
streams. A dead actor fails every pending request with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ConfigInvalid, ServerArgs
from m3serve.runtime.messages import (
    Abort,
    Error,
    Finish,
    GenerateReq,
    Ready,
    Shutdown,
    Stats,
    TextBatch,
    ToApi,
    TokenLogprob,
    ToScheduler,
    ToSupervisor,
    ToTokenizer,
    Usage,
)
from m3serve.runtime.shm import new_session_id
from m3serve.runtime.supervisor import StartupError, Supervisor
from m3serve.runtime.transport import (
    Inbox,
    InProcChannel,
    MailboxClosed,
    Outbox,
    ZmqInbox,
    ZmqOutbox,
)

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine (or one of its actors) is gone; no request can complete."""


class RequestError(RuntimeError):
    """The engine refused or failed one request (code: the HTTP status it maps to)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Chunk:
    """A piece of one request's output: new text and ids; `finish` set on the last one."""

    rid: str
    text: str
    output_ids: list[int]
    finish: Finish | None
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Stream:
    queue: asyncio.Queue[Chunk | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False


class AsyncEngine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.info: dict[str, Any] = {}
        self.healthy = False
        self.dead: EngineDeadError | None = None
        self.model_path: Path | None = None
        self._streams: dict[str, _Stream] = {}
        self._tokenizers: list[Outbox] = []
        self._scheduler: Outbox | None = None
        self._closables: list[Inbox | Outbox] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._supervisor: Supervisor | None = None
        self._in_process: Any = None
        self.actors: list[Any] = []
        self.stats: Stats | None = None  # the engine's latest load figures

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
        backend = check_backend(self.args.backend.backend, resolve_device(self.args.backend.device))
        if self.args.cache.kv_cache_dtype == "fp8_e4m3" and backend != "hopper":
            raise ConfigInvalid("--kv-cache-dtype fp8_e4m3 needs the hopper backend")
        session = new_session_id()
        run_dir = Path(tempfile.mkdtemp(prefix=f"m3s-{session}-"))
        self._supervisor = Supervisor(session, run_dir)
        try:
            if self.args.runtime.single_process:
                ready = await self._start_in_process(session)
            else:
                ready = await self._start_processes(session, run_dir)
        except BaseException:
            await self.shutdown()
            raise
        for message in ready.values():
            self.info.update(message.info)
        self.info["model_path"] = str(self.model_path)
        self.healthy = True

    async def _start_processes(self, session: str, run_dir: Path) -> dict[str, Ready]:
        from m3serve.actors.processes import Addresses, engine_process, tokenizer_process

        workers = self.args.runtime.tokenizer_worker_num
        addresses = Addresses.under(run_dir, workers)
        api = ZmqInbox(addresses.api, Codec(ToApi))
        control = ZmqInbox(addresses.control, Codec(ToSupervisor))
        self._tokenizers = [ZmqOutbox(a, Codec(ToTokenizer)) for a in addresses.tokenizers]
        self._scheduler = ZmqOutbox(addresses.scheduler, Codec(ToScheduler))
        self._closables = [api, control, *self._tokenizers, self._scheduler]
        sup = self._supervisor
        assert sup is not None and self.model_path is not None
        level = logging.getLogger().getEffectiveLevel()
        sup.spawn("engine", engine_process, addresses, self.model_path, self.args, level)
        for i in range(workers):
            sup.spawn(
                f"tokenizer{i}",
                tokenizer_process,
                addresses,
                i,
                self.model_path,
                self.args,
                session,
                level,
            )
        ready = await sup.wait_ready(control, self.args.runtime.startup_timeout)
        sup.watch(self._on_death)
        self._tasks = [
            asyncio.create_task(self._read(api), name="engine-outputs"),
            asyncio.create_task(self._read(control), name="engine-control"),
        ]
        return ready

    async def _start_in_process(self, session: str) -> dict[str, Ready]:
        from m3serve.actors.scheduler.actor import SchedulerActor
        from m3serve.actors.tokenizer import TokenizerActor

        assert self.model_path is not None
        workers = self.args.runtime.tokenizer_worker_num
        api, control, sched = InProcChannel(), InProcChannel(), InProcChannel()
        toks = [InProcChannel() for _ in range(workers)]
        self._tokenizers = [t.outbox() for t in toks]
        self._scheduler = sched.outbox()
        actors = [
            SchedulerActor(
                sched.inbox(),
                [t.outbox() for t in toks],
                control.outbox(),
                self.args,
                self.model_path,
            )
        ]
        for i, channel in enumerate(toks):
            actors.append(
                TokenizerActor(
                    channel.inbox(),
                    scheduler=sched.outbox(),
                    api=api.outbox(),
                    control=control.outbox(),
                    model_dir=self.model_path,
                    worker=i,
                    session=session,
                    skip_tokenizer_init=self.args.runtime.skip_tokenizer_init,
                    context_length=self.args.runtime.context_length,
                )
            )
        self.actors = actors  # for introspection in tests and embedded uses
        self._in_process = [asyncio.create_task(a.serve(), name=a.name) for a in actors]
        control_inbox = control.inbox()
        ready: dict[str, Ready] = {}
        while len(ready) < len(actors):
            message = await asyncio.wait_for(
                control_inbox.recv(), self.args.runtime.startup_timeout
            )
            if isinstance(message, Error):
                raise StartupError(message.message)
            ready[message.actor] = message
        self._tasks = [
            asyncio.create_task(self._read(api.inbox()), name="engine-outputs"),
            asyncio.create_task(self._read(control_inbox), name="engine-control"),
        ]
        return ready

    async def shutdown(self) -> None:
        self.healthy = False
        for outbox in [*self._tokenizers, self._scheduler]:
            if outbox is not None:
                # A dead peer's mailbox may refuse; the supervisor handles the rest.
                with contextlib.suppress(Exception):
                    await outbox.send(Shutdown())
        if self._in_process:
            await asyncio.wait(self._in_process, timeout=30)
            self._in_process = None
        self.actors = []
        if self._supervisor is not None:
            await self._supervisor.shutdown()
            self._supervisor = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for box in self._closables:
            box.close()
        self._closables = []
        self._fail_all(EngineDeadError("the engine was shut down"))

    @property
    def processes(self) -> dict[str, int]:
        """Actor process name -> pid (empty in single-process mode)."""
        if self._supervisor is None:
            return {}
        return {name: proc.pid for name, proc in self._supervisor.procs.items() if proc.pid}

    # ------------------------------------------------------------------ requests

    def worker_of(self, rid: str) -> int:
        return zlib.crc32(rid.encode()) % len(self._tokenizers)

    async def stream(self, req: GenerateReq) -> AsyncIterator[Chunk]:
        """Submit a request and yield its output chunks; closing the iterator early aborts it."""
        if self.dead is not None:
            raise self.dead
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if req.rid in self._streams:
            raise RequestError(f"request id {req.rid!r} is already in use")
        state = _Stream()
        self._streams[req.rid] = state
        try:
            await self._tokenizers[self.worker_of(req.rid)].send(req)
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
            if not state.done and self.healthy:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        if self.healthy:
            await self._tokenizers[self.worker_of(rid)].send(Abort(rid))

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
            elif isinstance(message, Stats):
                self.stats = message

    def _deliver(self, batch: TextBatch) -> None:
        for i, rid in enumerate(batch.rids):
            state = self._streams.get(rid)
            if state is None:
                continue
            logprobs = batch.logprobs[i] if batch.logprobs is not None else []
            chunk = Chunk(
                rid,
                batch.deltas[i],
                batch.new_ids[i],
                batch.finish[i],
                batch.usage[i],
                logprobs,
            )
            state.queue.put_nowait(chunk)

    def _deliver_error(self, error: Error) -> None:
        if error.rid is None:
            self._die(EngineDeadError(error.message))
            return
        state = self._streams.get(error.rid)
        if state is not None:
            state.queue.put_nowait(RequestError(error.message, error.code))

    def _on_death(self, name: str, exitcode: int | None) -> None:
        self._die(EngineDeadError(f"the {name} process exited unexpectedly (exit code {exitcode})"))

    def _die(self, error: EngineDeadError) -> None:
        if self.dead is None:
            log.error("%s", error)
            self.dead = error
        self.healthy = False
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in self._streams.values():
            state.queue.put_nowait(error)
