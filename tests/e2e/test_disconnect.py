"""A client that goes away mid-generation frees its request's KV pages.

The app runs in-process on a real socket (uvicorn in a background thread with its own event
loop, the single-process engine inside it), so the scheduler's page pool can be inspected while
an HTTP client streams from it, or waits on it, and then hangs up. The scheduler is only touched
from the server's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.runtime.config import ServerArgs

T = TypeVar("T")

MAX_NEW_TOKENS = 2000  # far more than the test waits for: the request is cut off, not finished
IDLE_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0
BODY = {
    "messages": [{"role": "user", "content": "Write a very long story about sparse attention."}],
    "max_tokens": MAX_NEW_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Live:
    url: str
    loop: asyncio.AbstractEventLoop
    engine: AsyncEngine

    @property
    def scheduler(self) -> Any:
        actor = next(a for a in self.engine.actors if type(a).__name__ == "SchedulerActor")
        return actor.core.scheduler

    async def on_server_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the server's event loop, between the scheduler's steps."""

        async def call() -> T:
            return fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self.loop))

    async def kv(self) -> dict[str, int]:
        s = self.scheduler
        return await self.on_server_loop(
            lambda: {
                "free": s.pool.num_free,
                "cached": s.cache.tree.cached_pages,
                "running": len(s.running),
                "waiting": len(s.waiting),
                "total": s.pool.num_pages,
            }
        )

    async def wait_idle(self) -> dict[str, int]:
        """Poll until no request is running or waiting; then check the pool's accounting."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            state = await self.kv()
            if state["running"] == 0 and state["waiting"] == 0:
                await self.on_server_loop(self.scheduler.idle_check)
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"the aborted request still holds the scheduler: {state}")
            await asyncio.sleep(0.02)

    async def reset_cache(self) -> int:
        """Drop the prefix cache (at idle) and return the free pages: the leak baseline."""
        await self.wait_idle()
        s = self.scheduler
        await self.on_server_loop(s.cache.reset)
        state = await self.kv()
        assert state["cached"] == 0
        return state["free"]

    async def wait_generating(self, at_least: int) -> dict[str, int]:
        """Poll until one request is running and has produced `at_least` tokens."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        s = self.scheduler
        while True:
            produced = await self.on_server_loop(lambda: [len(r.output) for r in s.running])
            if produced and produced[0] >= at_least:
                return await self.kv()
            if time.monotonic() > deadline:
                pytest.fail(f"generation did not get under way: {produced}")
            await asyncio.sleep(0.02)


async def aborted_total(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("m3serve:request_aborted_total ")]
    return float(line.split()[1])


async def wait_aborted(http: httpx.AsyncClient, before: float) -> float:
    """The aborted-requests counter once it has moved past `before` (or after a timeout)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while (now := await aborted_total(http)) == before and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return now


@pytest.fixture(scope="module")
def live(model_path: Path) -> Iterator[Live]:
    args = ServerArgs.from_kwargs(
        model_path=str(model_path), single_process=True, max_total_tokens=4096
    )
    engine = AsyncEngine(args)
    app = create_app(engine, own_engine=True)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="asyncio", lifespan="on", log_level="warning"
    )
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve())
        except BaseException as exc:  # surfaced by the fixture, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="uvicorn-under-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert thread.is_alive(), f"the server thread died: {failure}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                break
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.05)
    try:
        yield Live(url, loop, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not shut down"
        assert failure == []
        assert not engine.healthy  # the app owned the engine and shut it down
        loop.close()


async def test_closing_a_stream_mid_generation_frees_its_kv(live: Live) -> None:
    baseline = await live.reset_cache()
    async with httpx.AsyncClient(base_url=live.url, timeout=30.0) as http:
        aborted_before = await aborted_total(http)
        async with http.stream(
            "POST", "/v1/chat/completions", json={**BODY, "stream": True}
        ) as response:
            assert response.status_code == 200
            # Read through one iterator kept alive: abandoning an httpx line iterator closes
            # the connection as soon as it is garbage-collected, which would hang up early.
            lines = response.aiter_lines()
            events = []
            while len(events) < 4:
                line = await anext(lines)
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
            assert all(e["object"] == "chat.completion.chunk" for e in events)
            busy = await live.wait_generating(at_least=len(events))
            assert busy["running"] == 1
            assert busy["free"] + busy["cached"] < baseline  # the request holds pages
        # Leaving the block closes the unfinished response, which drops the connection.
        idle = await live.wait_idle()
        assert idle["free"] + idle["cached"] == baseline
        await live.on_server_loop(live.scheduler.cache.reset)
        assert (await live.kv())["free"] == baseline == idle["total"]
        assert await wait_aborted(http, aborted_before) == aborted_before + 1


async def test_cancelling_a_non_streaming_request_frees_its_kv(live: Live) -> None:
    baseline = await live.reset_cache()
    async with httpx.AsyncClient(base_url=live.url, timeout=60.0) as http:
        aborted_before = await aborted_total(http)

        # A fresh client for the request, so cancelling it cannot disturb the metrics client.
        async def post() -> httpx.Response:
            async with httpx.AsyncClient(base_url=live.url, timeout=60.0) as own:
                return await own.post("/v1/chat/completions", json=BODY)

        request = asyncio.create_task(post())
        busy = await live.wait_generating(at_least=8)
        assert not request.done()
        assert busy["running"] == 1
        assert busy["free"] + busy["cached"] < baseline
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        idle = await live.wait_idle()
        assert idle["free"] + idle["cached"] == baseline
        await live.on_server_loop(live.scheduler.cache.reset)
        assert (await live.kv())["free"] == baseline == idle["total"]
        # The handler saw the disconnect (499, counted as aborted), not a finished request.
        assert await wait_aborted(http, aborted_before) == aborted_before + 1


async def test_server_still_serves_after_the_disconnects(live: Live) -> None:
    baseline = await live.reset_cache()
    async with httpx.AsyncClient(base_url=live.url, timeout=30.0) as http:
        response = await http.post("/v1/chat/completions", json={**BODY, "max_tokens": 4})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
    idle = await live.wait_idle()
    assert idle["free"] + idle["cached"] == baseline
