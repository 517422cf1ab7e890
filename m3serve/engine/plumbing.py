"""The request side of `AsyncEngine`: the state it keeps per request and per tokenize call, each
request sent to the tokenizer worker that owns its rid, and the outputs and replies routed back
into per-request streams and futures."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3serve.engine.chat import messages_media
from m3serve.engine.errors import EngineDeadError, RequestError
from m3serve.engine.launch import ActorGraph
from m3serve.engine.workers import TokenizerWorkers
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import (
    Abort,
    DetokenizeReq,
    DetokenizeResult,
    GenerateReq,
    MediaBlob,
    RequestOutput,
    TextBatch,
    TokenizeReq,
    TokenizeResult,
)


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the first is not its last): the new text,
    ids and logprobs of both; the later one's finish and (cumulative) usage."""
    return RequestOutput(
        first.rid,
        first.text + later.text,
        first.output_ids + later.output_ids,
        later.finish,
        later.usage,
        first.logprobs + later.logprobs,
    )


@dataclass
class _Stream:
    worker: int  # the tokenizer worker that tokenizes and detokenizes the request
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False


class RequestPlumbing:
    """Requests out to the tokenizer workers and their outputs back; `AsyncEngine` adds the
    lifecycle that starts the actors this talks to."""

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
            held: RequestOutput | BaseException | None = None
            while True:
                item = held if held is not None else await state.queue.get()
                held = None
                # A consumer that fell behind (a busy event loop, a slow client) takes what
                # queued up meanwhile as one output: under load the per-output work (SSE frame,
                # write, wake-up) then scales with requests, not tokens, so it cannot fall
                # further behind.
                while isinstance(item, RequestOutput) and item.finish is None:
                    if state.queue.empty():
                        break
                    later = state.queue.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = merge_outputs(item, later)
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
        media: list[MediaBlob] | None = None,
    ) -> list[int]:
        """The token ids of `prompt`, or of the chat template rendered over `messages` (their
        `media` parts' placeholders expanded, as for generation), as a tokenizer worker encodes
        them (raises RequestError for a refusal). Without `media`, the messages' image_url and
        video_url parts are loaded here."""
        if messages is not None and media is None:
            messages, media = await messages_media(messages, self.args.media)
        rid = "tok-" + uuid.uuid4().hex
        req = TokenizeReq(
            rid=rid,
            prompt=prompt,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            media=media or [],
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

    def _deliver(self, batch: TextBatch) -> None:
        for output in batch.outputs:
            state = self._streams.get(output.rid)
            if state is not None:
                state.queue.put_nowait(output)

    def _answer(self, rid: str, reply: TokenizeResult | DetokenizeResult | BaseException) -> None:
        call = self._calls.get(rid)
        if call is None or call.done():
            return  # its caller gave up
        if isinstance(reply, BaseException):
            call.set_exception(reply)
        else:
            call.set_result(reply)

    def _fail_all(self, error: BaseException) -> None:
        for state in self._streams.values():
            state.queue.put_nowait(error)
        for rid in list(self._calls):
            self._answer(rid, error)
