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
import logging
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


def serve_live(model_path: Path, **settings: Any) -> Iterator[Live]:
    """The app on uvicorn in a background thread, around a single-process engine built from
    `settings` (ServerArgs keywords); shut down when the generator is closed."""
    args = ServerArgs.from_kwargs(model_path=str(model_path), single_process=True, **settings)
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


@pytest.fixture(scope="module")
def live(model_path: Path) -> Iterator[Live]:
    yield from serve_live(model_path, max_total_tokens=4096)


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


# ---------------------------------------------------------------------- before the first token

LONG_PROMPT = [10 + (i * 7919) % 390 for i in range(6000)]  # ~100 prefill chunks of 64
SHORT_PROMPT = LONG_PROMPT[:2000]


@pytest.fixture(scope="module")
def slow_prefill(model_path: Path) -> Iterator[Live]:
    """Prefill in chunks of 64 tokens, so a long prompt takes many steps: a client can leave
    while its request is still queued behind it, or while it is being prefilled."""
    yield from serve_live(
        model_path, max_total_tokens=16384, chunked_prefill_size=64, request_body_timeout=1.0
    )


def completion(prompt: list[int], stream: bool) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}


def start_request(live: Live, body: dict[str, Any]) -> asyncio.Task[httpx.Response]:
    """The request on a client of its own, so that cancelling the task drops its connection."""

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(base_url=live.url, timeout=120.0) as own:
            return await own.post("/v1/completions", json=body)

    return asyncio.create_task(post())


async def hang_up(request: asyncio.Task[httpx.Response]) -> None:
    assert not request.done()  # no response yet: the first token has not been produced
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def wait_for(live: Live, what: Callable[[Any], T], ready: Callable[[T], bool]) -> T:
    """Poll `what(scheduler)` on the server's loop until `ready` holds for it."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        value = await live.on_server_loop(lambda: what(live.scheduler))
        if ready(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"the scheduler never got there: {value}")
        await asyncio.sleep(0.01)


def load_gauges(metrics: str) -> tuple[float, float]:
    found = dict(line.split(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    return float(found["m3serve:num_running_reqs"]), float(found["m3serve:num_waiting_reqs"])


async def test_a_queued_request_whose_client_left_is_never_prefilled(slow_prefill: Live) -> None:
    live = slow_prefill
    baseline = await live.reset_cache()
    blocker = start_request(live, completion(LONG_PROMPT, stream=True))
    await wait_for(live, lambda s: len(s.running), lambda n: n == 1)
    queued_request = start_request(live, completion(SHORT_PROMPT, stream=False))
    queued = await wait_for(live, lambda s: list(s.waiting), lambda w: len(w) == 1)
    await hang_up(queued_request)
    await wait_for(live, lambda s: len(s.waiting), lambda n: n == 0)
    (req,) = queued
    assert req.finish is not None and req.finish.reason == "abort"
    assert not req.admitted_once and req.kv_len == 0  # never given a slot, never prefilled
    still = await live.on_server_loop(lambda: [r.prefilled for r in live.scheduler.running])
    assert still == [False]  # it left while the blocker was still prefilling
    await hang_up(blocker)
    idle = await live.wait_idle()
    assert idle["free"] + idle["cached"] == baseline


async def test_a_prefilling_request_whose_client_left_is_aborted_and_frees_its_pages(
    slow_prefill: Live,
) -> None:
    live = slow_prefill
    baseline = await live.reset_cache()
    async with httpx.AsyncClient(base_url=live.url, timeout=30.0) as http:
        aborted_before = await aborted_total(http)
        request = start_request(live, completion(LONG_PROMPT, stream=True))
        running = await wait_for(
            live, lambda s: list(s.running), lambda r: len(r) == 1 and r[0].kv_len > 0
        )
        (req,) = running
        await hang_up(request)
        idle = await live.wait_idle()
        assert idle["free"] + idle["cached"] == baseline
        assert req.finish is not None and req.finish.reason == "abort"
        assert req.kv_len < len(LONG_PROMPT) and req.output == []  # cut off mid-prefill
        assert await wait_aborted(http, aborted_before) == aborted_before + 1
        # /metrics agrees once the engine loop has written its gauges after the abort.
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (gauges := load_gauges((await http.get("/metrics")).text)) != (0.0, 0.0):
            assert time.monotonic() < deadline, f"running, waiting stay at {gauges}"
            await asyncio.sleep(0.02)


# ---------------------------------------------------------------------- mid-body

HEAD = (
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
)


async def send_part_of_a_body(live: Live) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = live.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HEAD.encode() + b'{"messages": [')  # 14 of the 1000 bytes promised
    await writer.drain()
    return reader, writer


async def test_a_body_shorter_than_its_content_length_times_out_with_408(
    slow_prefill: Live,
) -> None:
    reader, writer = await send_part_of_a_body(slow_prefill)
    try:
        answer = await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", answer[:200]
    assert b'"code":408' in rest


async def test_a_client_leaving_mid_body_is_one_499_line_without_a_traceback(
    slow_prefill: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    uvicorn_errors = logging.getLogger("uvicorn.error")  # does not propagate to the root
    uvicorn_errors.addHandler(caplog.handler)
    try:
        async with httpx.AsyncClient(base_url=slow_prefill.url, timeout=30.0) as http:
            before = closed_requests((await http.get("/metrics")).text)
            _, writer = await send_part_of_a_body(slow_prefill)
            writer.close()
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while closed_requests((await http.get("/metrics")).text) == before:
                assert time.monotonic() < deadline, "the hang-up was never counted"
                await asyncio.sleep(0.02)
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
    # The test's own httpx client logs its /metrics calls too, and a server port such as
    # 44990 puts "499" in those lines: only the server's lines count.
    lines = [r for r in caplog.records if r.name != "httpx" and "499" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, lines
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def closed_requests(metrics: str) -> float:
    key = 'm3serve:request_total{endpoint="/v1/chat/completions",status="499"}'
    found = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith(key))
    return float(found.get(key, 0.0))
