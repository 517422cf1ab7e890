"""The SGLang-style offline `Engine`: sync calls from anywhere, `async_*` calls from any host
event loop, results as SGLang's dicts (`text`, `output_ids`, `meta_info`)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np

from m3serve.engine.async_engine import AsyncEngine, RequestError
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import (
    Finish,
    GenerateReq,
    RequestOutput,
    SamplingParams,
    TokenIds,
    TokenLogprob,
    Usage,
)

Prompt = str | list[int]

T = TypeVar("T")


class Engine:
    """SGLang-style offline engine: `Engine(model_path=None, **server_args)`.

    Runs an `AsyncEngine` on a private event loop thread, so sync calls work anywhere and the
    `async_*` methods work inside any host event loop (which is never created or closed here).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        server_args: ServerArgs | None = None,
        **kwargs: Any,
    ) -> None:
        if server_args is None:
            server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        elif model_path is not None or kwargs:
            raise ValueError("pass either server_args or model_path/keyword arguments")
        self.args = server_args
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="m3serve-engine-loop", daemon=True
        )
        self._thread.start()
        self.async_engine = AsyncEngine(self.args)
        try:
            self._call(self.async_engine.start())
        except BaseException:
            self._stop_loop()
            raise
        self._closed = False

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
    ) -> Any:
        """One prompt -> a dict; a list of prompts -> a list of dicts; stream=True -> an
        iterator of incremental dicts (one prompt only)."""
        reqs, single = _requests(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        if stream:
            return self._stream_sync(_only(reqs, single))
        results = self._call(self._collect_all(reqs))
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
    ) -> Any:
        """Awaitable from any event loop; with stream=True returns an async iterator."""
        reqs, single = _requests(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        if stream:
            return self._stream_async(_only(reqs, single))
        results = await self._await(self._collect_all(reqs))
        return results[0] if single else results

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        stream: bool = False,
        thinking: str | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> Any:
        req = GenerateReq(
            rid=rid or uuid.uuid4().hex,
            messages=messages,
            tools=tools,
            sampling=_sampling(sampling_params, False, 0),
            stream=stream,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            chat_template_kwargs=chat_template_kwargs,
        )
        if stream:
            return self._stream_sync(req)
        return self._call(self._collect(req))

    def abort(self, rid: str) -> None:
        self._call(self.async_engine.abort(rid))

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.async_engine.shutdown())
        finally:
            self._stop_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def server_info(self) -> dict[str, Any]:
        return dict(self.async_engine.info)

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wrap_future(future)

    async def _collect_all(self, reqs: list[GenerateReq]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._collect(r) for r in reqs)))

    async def _collect(self, req: GenerateReq) -> dict[str, Any]:
        started = time.monotonic()
        out = _Output(req.rid)
        async for chunk in self.async_engine.stream(req):
            out.add(chunk)
        return out.as_dict(time.monotonic() - started)

    def _stream_sync(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        items: queue.Queue[Any] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._pump(req, items.put), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # a consumer that stops early aborts the request

    async def _stream_async(self, req: GenerateReq) -> AsyncIterator[dict[str, Any]]:
        host = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            host.call_soon_threadsafe(items.put_nowait, item)

        future = asyncio.run_coroutine_threadsafe(self._pump(req, put), self._loop)
        try:
            while (item := await items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def _pump(self, req: GenerateReq, put: Any) -> None:
        started = time.monotonic()
        try:
            async for chunk in self.async_engine.stream(req):
                out = _Output(req.rid)
                out.add(chunk)
                put(out.as_dict(time.monotonic() - started))
        except BaseException as exc:  # delivered to the consumer, raised there
            put(exc)
        finally:
            put(_END)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


_END = object()


@dataclass
class _Output:
    """Accumulates chunks into SGLang's result dict."""

    rid: str
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish: Finish | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: RequestOutput) -> None:
        self.text += chunk.text
        self.ids.extend(chunk.output_ids)
        self.finish = chunk.finish or self.finish
        self.usage = chunk.usage
        self.logprobs.extend(chunk.logprobs)

    def as_dict(self, latency: float) -> dict[str, Any]:
        usage = self.usage or Usage(0, 0, 0)
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "finish_reason": _finish_dict(self.finish),
            "e2e_latency": latency,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [(lp.logprob, lp.token_id) for lp in self.logprobs]
            if any(lp.top for lp in self.logprobs):
                meta["output_top_logprobs"] = [
                    [(value, token) for token, value in lp.top] for lp in self.logprobs
                ]
        return {"text": self.text, "output_ids": self.ids, "meta_info": meta}


def _finish_dict(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    out: dict[str, Any] = {"type": finish.reason}
    if finish.reason == "stop" and finish.matched is not None:
        out["matched"] = finish.matched
    if finish.reason == "error" and finish.matched is not None:
        out["message"] = finish.matched
    return out


def _sampling(params: dict[str, Any] | None, logprob: bool, top: int) -> SamplingParams:
    values = dict(params or {})
    if logprob or top:
        values.setdefault("logprobs", True)
        values.setdefault("top_logprobs", top)
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid sampling_params: {exc}") from exc


def _requests(
    prompt: Prompt | list[Prompt] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    return_logprob: bool,
    top_logprobs_num: int,
) -> tuple[list[GenerateReq], bool]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt or input_ids")
    if prompt is not None:
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        items: list[Any] = [prompt] if single else list(prompt)
    else:
        assert input_ids is not None
        single = not input_ids or isinstance(input_ids[0], int)
        items = [input_ids] if single else list(input_ids)
    params = (
        sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
    )
    rids = rid if isinstance(rid, list) else [rid] * len(items)
    if len(params) != len(items) or len(rids) != len(items):
        raise ValueError("sampling_params and rid lists must match the number of prompts")
    reqs = []
    for item, param, one_rid in zip(items, params, rids, strict=True):
        req = GenerateReq(
            rid=one_rid or uuid.uuid4().hex,
            sampling=_sampling(param, return_logprob, top_logprobs_num),
        )
        if isinstance(item, str):
            req.prompt = item
        else:
            if any(not 0 <= t < 2**31 for t in item):
                raise RequestError(f"token id outside the vocabulary in {item[:8]}...")
            req.input_ids = TokenIds(len(item), np.asarray(item, dtype=np.int32))
        reqs.append(req)
    return reqs, single


def _only(reqs: list[GenerateReq], single: bool) -> GenerateReq:
    if not single:
        raise ValueError("stream=True takes one prompt")
    req = reqs[0]
    req.stream = True
    return req


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
