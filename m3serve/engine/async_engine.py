"""`AsyncEngine`: the engine inside a running event loop (what the API server holds).

It starts the actor graph (`launch.py`) — as processes talking over ZeroMQ, or with
`single_process=True` as tasks in the current loop — sends each request to the tokenizer worker
that owns it and routes the returning `RequestOutput`s into per-request streams; `tokenize` and
`detokenize` are one-message round trips to a worker. A dead actor fails every pending request
with `EngineDeadError`. `metrics` is the engine's Prometheus
metrics, readable in this process whichever way the actors run.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3serve.engine.launch import ActorGraph, start_in_process, start_processes
from m3serve.runtime.actor import Actor
from m3serve.runtime.config import ConfigInvalid, ServerArgs
from m3serve.runtime.messages import (
    Abort,
    DetokenizeReq,
    DetokenizeResult,
    Error,
    GenerateReq,
    RequestOutput,
    TextBatch,
    TokenizeReq,
    TokenizeResult,
)
from m3serve.runtime.shm import new_session_id
from m3serve.runtime.supervisor import Supervisor
from m3serve.runtime.transport import Inbox, MailboxClosed, Outbox

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine (or one of its actors) is gone; no request can complete."""


class RequestError(RuntimeError):
    """The engine refused or failed one request (code: the HTTP status it maps to)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False


class AsyncEngine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.info: dict[str, Any] = {}
        self.healthy = False
        self.dead: EngineDeadError | None = None
        self.model_path: Path | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[str, asyncio.Future[TokenizeResult | DetokenizeResult]] = {}
        self._graph: ActorGraph | None = None
        self._tasks: list[asyncio.Task[Any]] = []

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
        session = new_session_id()
        supervisor = Supervisor(session, Path(tempfile.mkdtemp(prefix=f"m3s-{session}-")))
        launch = start_in_process if self.args.runtime.single_process else start_processes
        try:
            self._graph = await launch(self.args, self.model_path, supervisor)
        except BaseException:
            await supervisor.shutdown()
            raise
        graph = self._graph
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
        if self._graph is not None:
            await self._graph.shutdown()
            self._graph = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all(EngineDeadError("the engine was shut down"))

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

    def _tokenizer_of(self, rid: str) -> Outbox:
        assert self._graph is not None
        tokenizers = self._graph.tokenizers
        return tokenizers[zlib.crc32(rid.encode()) % len(tokenizers)]

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they arrive; closing the iterator early
        aborts it."""
        if self.dead is not None:
            raise self.dead
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if req.rid in self._streams:
            raise RequestError(f"request id {req.rid!r} is already in use")
        state = _Stream()
        self._streams[req.rid] = state
        try:
            await self._tokenizer_of(req.rid).send(req)
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

    @property
    def num_requests(self) -> int:
        """Generation requests submitted and not yet finished."""
        return len(self._streams)

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The token ids of `prompt`, or of the chat template rendered over `messages`, as a
        tokenizer worker encodes them (raises RequestError for a refusal)."""
        rid = "tok-" + uuid.uuid4().hex
        req = TokenizeReq(
            rid=rid, prompt=prompt, messages=messages, add_generation_prompt=add_generation_prompt
        )
        reply = await self._call(rid, req)
        assert isinstance(reply, TokenizeResult)
        return reply.token_ids

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens kept (raises RequestError for a refusal)."""
        rid = "detok-" + uuid.uuid4().hex
        reply = await self._call(rid, DetokenizeReq(rid, token_ids))
        assert isinstance(reply, DetokenizeResult)
        return reply.text

    async def _call(
        self, rid: str, req: TokenizeReq | DetokenizeReq
    ) -> TokenizeResult | DetokenizeResult:
        if self.dead is not None:
            raise self.dead
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        reply = asyncio.get_running_loop().create_future()
        self._calls[rid] = reply
        try:
            await self._tokenizer_of(rid).send(req)
            return await reply
        finally:
            self._calls.pop(rid, None)

    async def abort(self, rid: str) -> None:
        if self.healthy:
            await self._tokenizer_of(rid).send(Abort(rid))

    async def _read(self, inbox: Inbox) -> None:
        """Route what the actors send back (outputs, request errors, crash reports)."""
        while True:
            try:
                message = await inbox.recv()
            except MailboxClosed:
                return
            if isinstance(message, TextBatch):
                self._deliver(message)
            elif isinstance(message, (TokenizeResult, DetokenizeResult)):
                self._answer(message.rid, message)
            elif isinstance(message, Error):
                self._deliver_error(message)

    def _deliver(self, batch: TextBatch) -> None:
        for output in batch.outputs:
            state = self._streams.get(output.rid)
            if state is not None:
                state.queue.put_nowait(output)

    def _deliver_error(self, error: Error) -> None:
        if error.rid is None:
            self._die(EngineDeadError(error.message))
            return
        state = self._streams.get(error.rid)
        if state is not None:
            state.queue.put_nowait(RequestError(error.message, error.code))
        self._answer(error.rid, RequestError(error.message, error.code))

    def _answer(self, rid: str, reply: TokenizeResult | DetokenizeResult | BaseException) -> None:
        call = self._calls.get(rid)
        if call is None or call.done():
            return  # its caller gave up
        if isinstance(reply, BaseException):
            call.set_exception(reply)
        else:
            call.set_result(reply)

    def _on_death(self, name: str, exitcode: int | None) -> None:
        if self._graph is not None:
            self._graph.forget_metrics_of(name)
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
        for rid in list(self._calls):
            self._answer(rid, error)
