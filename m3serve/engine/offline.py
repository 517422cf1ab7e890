"""The SGLang-style offline `Engine`: sync calls from anywhere, `async_*` calls from any host
event loop, results as SGLang's dicts (`text`, `output_ids`, `meta_info`)."""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from m3serve.engine.async_engine import AsyncEngine
from m3serve.engine.chat import with_media
from m3serve.engine.requests import Prompt, generate_requests, sampling, stream_request
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import GenerateReq

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
        reqs, single = generate_requests(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        if stream:
            return self._stream_sync(stream_request(reqs, single))
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
        reqs, single = generate_requests(
            prompt, input_ids, sampling_params, rid, return_logprob, top_logprobs_num
        )
        if stream:
            return self._stream_async(stream_request(reqs, single))
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
            sampling=sampling(sampling_params),
            stream=stream,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            chat_template_kwargs=chat_template_kwargs,
        )
        # Messages may carry image_url / video_url parts, as at the API.
        req = self._call(with_media(req, self.async_engine.args.media))
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
        return await self.async_engine._collect(req)

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
        try:
            async for chunk in self.async_engine._increments(req):
                put(chunk)
        except BaseException as exc:  # delivered to the consumer, raised there
            put(exc)
        finally:
            put(_END)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


_END = object()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
