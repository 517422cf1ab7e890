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
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3serve.engine.chat import chat_request, parsed, with_media
from m3serve.engine.checks import checked_off_the_loop
from m3serve.engine.errors import EngineDeadError, RequestError
from m3serve.engine.hicache import HICACHE
from m3serve.engine.launch import ActorGraph, start_in_process, start_processes
from m3serve.engine.requests import (
    Prompt,
    Result,
    SamplingArg,
    generate_requests,
    stream_request,
    with_keywords,
)
from m3serve.engine.workers import TokenizerWorkers, worker_index
from m3serve.runtime.actor import Actor
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import (
    Abort,
    DetokenizeReq,
    DetokenizeResult,
    Error,
    GenerateReq,
    Ready,
    RequestOutput,
    TextBatch,
    TokenizeReq,
    TokenizeResult,
)
from m3serve.runtime.orphans import new_run_dir, remove_orphans
from m3serve.runtime.shm import new_session_id
from m3serve.runtime.supervisor import Supervisor
from m3serve.runtime.transport import Inbox, MailboxClosed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


__all__ = ["AsyncEngine", "EngineDeadError", "RequestError"]


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
        self._calls: dict[str, asyncio.Future[TokenizeResult | DetokenizeResult]] = {}
        self._call_workers: dict[str, int] = {}  # rid of a call -> the worker answering it
        self._graph: ActorGraph | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._restart_timers: dict[int, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------------ lifecycle

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

    def _worker_for(self, rid: str) -> tuple[TokenizerWorkers, int]:
        """The live tokenizer worker a new request goes to; raises why there is none."""
        if self.dead is not None:
            raise self.dead
        if not self.healthy or self.workers is None:
            raise EngineDeadError("the engine is not running")
        if self.closing is not None:
            raise RequestError(self.closing, 503)
        worker = self.workers.route(rid)
        if worker is None:
            raise RequestError(str(self.unavailable), 503)
        return self.workers, worker

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they arrive; closing the iterator early
        aborts it."""
        workers, worker = self._worker_for(req.rid)
        if req.rid in self._streams:
            raise RequestError(f"request id {req.rid!r} is already in use")
        state = _Stream(worker)
        self._streams[req.rid] = state
        try:
            await workers.outboxes[worker].send(req)
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
        workers, worker = self._worker_for(rid)
        reply = asyncio.get_running_loop().create_future()
        self._calls[rid] = reply
        self._call_workers[rid] = worker
        try:
            await workers.outboxes[worker].send(req)
            return await reply
        finally:
            self._calls.pop(rid, None)
            self._call_workers.pop(rid, None)

    async def generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: SamplingArg = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
        **sampling: Any,
    ) -> Any:
        """Generate from a prompt (text or token ids; or `input_ids=`): SGLang's result dict
        (`text`, `output_ids`, `meta_info`), or a list of them for a list of prompts. Sampling
        is a plain dict and/or keywords with SGLang's names (`temperature`, `max_new_tokens`,
        `top_p`, `stop`, `seed`, ...)."""
        params = with_keywords(sampling_params, sampling)
        reqs, single = generate_requests(
            prompt, input_ids, params, rid, return_logprob, top_logprobs_num
        )
        results = await asyncio.gather(*(self._collect(req) for req in reqs))
        return results[0] if single else list(results)

    async def generate_stream(
        self,
        prompt: Prompt | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """`generate` for one prompt, as it is written: each dict holds the new text and token
        ids; the last one has the finish reason. Leaving the loop early aborts the request."""
        params = with_keywords(sampling_params, sampling)
        reqs, single = generate_requests(
            prompt, input_ids, params, rid, return_logprob, top_logprobs_num
        )
        async for chunk in self._increments(stream_request(reqs, single)):
            yield chunk

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        thinking: str | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        rid: str | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """One chat turn through the model's chat template, parsed as the API parses it: the
        generate result plus `content`, `reasoning_content` (None without reasoning) and
        `tool_calls` (OpenAI's shape: id, type, function name and JSON arguments). Messages
        and tools are OpenAI chat dicts; thinking is enabled, disabled or adaptive."""
        req = chat_request(
            messages, tools, sampling, thinking, reasoning_effort, chat_template_kwargs, rid
        )
        req = await with_media(req, self.args.media)
        return parsed(await self._collect(req), req)

    async def _collect(self, req: GenerateReq) -> dict[str, Any]:
        started = time.monotonic()
        result = Result(req.rid)
        async for chunk in self.stream(req):
            result.add(chunk)
        return result.as_dict(time.monotonic() - started)

    async def _increments(self, req: GenerateReq) -> AsyncIterator[dict[str, Any]]:
        started = time.monotonic()
        async for chunk in self.stream(req):
            result = Result(req.rid)
            result.add(chunk)
            yield result.as_dict(time.monotonic() - started)

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
            elif isinstance(message, (TokenizeResult, DetokenizeResult)):
                self._answer(message.rid, message)
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
            if error.actor == HICACHE:
                log.error("%s; the engine continues with HiCache disabled", error.message)
            elif self._restartable(error.actor):
                # Its process exits next; the supervisor's notice of that starts it again.
                log.error("%s", error.message)
            else:
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
        message = f"the {name} process exited unexpectedly (exit code {exitcode})"
        if name == HICACHE:
            # The engine notices this itself, fails what waited on it and goes on without it.
            log.error("%s; the engine continues with HiCache disabled", message)
            return
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
        for rid in [r for r, w in self._call_workers.items() if w == worker]:
            self._answer(rid, RequestError(f"{message}; send the request again", 503))
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
        for rid in list(self._calls):
            self._answer(rid, error)
