"""Fixtures for in-process HTTP tests: an app around a ScriptedEngine, driven by httpx.

`serve(script_or_engine, args)` is an async context manager yielding a `Served`: the app (with
its lifespan run), its engine and an httpx client on it. `ApiArgs` default to both MiniMax-M3
parsers on. With `streaming=True` the client runs on `StreamingASGITransport`, which streams the
response body as the app sends it (httpx's own ASGITransport buffers the whole response), so a
test can hang up mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.scripted_engine import Script, ScriptedEngine
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message

from m3serve.api.app import create_app
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ApiArgs

PARSERS = ApiArgs(reasoning_parser="minimax-m3", tool_call_parser="minimax-m3")
TINY = TinySpec(dtype="float32", seed=1)


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    """A real model directory: tokenizer, chat template and generation_config for the state."""
    return tiny_checkpoint(TINY)


def parse_sse(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body: JSON objects, and the literal "[DONE]"."""
    assert body.endswith("\n\n"), body[-80:]
    events: list[Any] = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@dataclass
class Served:
    app: Starlette
    engine: ScriptedEngine
    client: httpx.AsyncClient

    async def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return await self.client.post(path, json=body, **kwargs)

    async def events(self, path: str, body: dict[str, Any], **kwargs: Any) -> list[dict]:
        """Stream a request; check the SSE framing and [DONE]; the JSON events before it."""
        response = await self.post(path, {**body, "stream": True}, **kwargs)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.text)
        assert events[-1] == "[DONE]"
        assert "[DONE]" not in events[:-1]
        return events[:-1]


Serve = Callable[..., contextlib.AbstractAsyncContextManager[Served]]


@pytest.fixture
def serve(model_dir: Path) -> Serve:
    @contextlib.asynccontextmanager
    async def make(
        script: Script | ScriptedEngine,
        args: ApiArgs = PARSERS,
        streaming: bool = False,
    ) -> AsyncIterator[Served]:
        engine = (
            script if isinstance(script, ScriptedEngine) else ScriptedEngine(script, str(model_dir))
        )
        app = create_app(engine, args)  # type: ignore[arg-type]
        # An unhandled error reaches the client as the 500 a real server would send.
        wire = (
            StreamingASGITransport(app)
            if streaming
            else httpx.ASGITransport(app=app, raise_app_exceptions=False)
        )
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=wire, base_url="http://test") as client,
        ):
            yield Served(app, engine, client)

    return make


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Runs the app in a task and hands its body parts to the client as they are sent; closing
    the response early tells the app `http.disconnect` and waits for it to wind down."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port),
            "client": ("127.0.0.1", 1234),
            "root_path": "",
        }
        sent_body = False
        hung_up = asyncio.Event()
        parts: asyncio.Queue[Message | None] = asyncio.Queue()

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await hung_up.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await parts.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await parts.put(None)

        task = asyncio.create_task(run())
        try:
            start = await parts.get()
        except asyncio.CancelledError:  # the client gave up before the response started
            hung_up.set()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=5)
            raise
        assert start is not None and start["type"] == "http.response.start"
        stream = _BodyStream(parts, hung_up, task)
        return httpx.Response(start["status"], headers=start["headers"], stream=stream)


class _BodyStream(httpx.AsyncByteStream):
    def __init__(
        self, parts: asyncio.Queue[Message | None], hung_up: asyncio.Event, task: asyncio.Task
    ) -> None:
        self.parts, self.hung_up, self.task = parts, hung_up, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (message := await self.parts.get()) is not None:
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    async def aclose(self) -> None:
        self.hung_up.set()
        await asyncio.wait_for(asyncio.gather(self.task, return_exceptions=True), timeout=5)
