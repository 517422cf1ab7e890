"""Input that cannot hurt the server, against the real engine (single process, tiny model):
requests the KV pool can never hold, fan-out, values the wire cannot carry and huge prompts
are refused up front with a 4xx, and a large /v1/tokenize leaves /health responsive."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from m3serve.actors.tokenizer import TokenizerActor

from .test_disconnect import Live, serve_live

POOL_TOKENS = 4096
CONTEXT = 65536  # the tiny checkpoint's
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[Live]:
    yield from serve_live(model_path, max_total_tokens=POOL_TOKENS)


async def post(live: Live, path: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=live.url, timeout=120.0) as http:
        return await http.post(path, json=body)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    return error


async def test_a_request_the_kv_pool_can_never_hold_is_a_400_with_the_numbers(
    server: Live,
) -> None:
    prompt = [10 + i % 300 for i in range(3000)]
    response = await post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2000})
    message = error_of(response, 400)["message"]
    assert "5000 KV tokens" in message and f"holds {POOL_TOKENS}" in message
    assert (await server.kv())["waiting"] == 0


async def test_a_request_beyond_the_context_is_a_400(server: Live) -> None:
    response = await post(server, "/v1/completions", {"prompt": [11, 12], "max_tokens": CONTEXT})
    assert "context length" in error_of(response, 400)["message"]


async def test_fan_out_beyond_the_per_request_cap_is_a_400(server: Live) -> None:
    body = {"prompt": ["Hi"] * 65, "n": 2, "max_tokens": 1}  # 130 engine requests
    response = await post(server, "/v1/completions", body)
    assert "--max-fanout" in error_of(response, 400)["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 18446744073709551616}',
        b'{"messages": [{"role": "user", "content": "Hi"}], "top_k": 18446744073709551615}',
        b'{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"a": '
        + b"[" * 1000
        + b"]" * 1000
        + b"}}",
    ],
    ids=["max_tokens-2**64", "top_k-2**64-1", "nested-1000"],
)
async def test_values_the_wire_cannot_carry_are_400s(server: Live, raw: bytes) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
        response = await http.post(CHAT, content=raw, headers={"content-type": "application/json"})
        health = await http.get("/health")
    error_of(response, 400)
    assert health.status_code == 200


async def test_a_prompt_beyond_max_prompt_chars_is_refused_before_tokenizing(
    server: Live,
) -> None:
    word = "a" * (16 * CONTEXT + 1)  # one word: the tokenizer's worst case
    for path, body in [
        ("/v1/tokenize", {"prompt": word}),
        ("/v1/completions", {"prompt": word, "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": word}], "max_tokens": 1}),
    ]:
        message = error_of(await post(server, path, body), 400)["message"]
        assert "--max-prompt-chars" in message, path


class Watched:
    """A tokenizer worker's tokenizer that tells the test when an encode starts and ends."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.started = threading.Event()
        self.ended = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        return self._watch(self.tokenizer.encode, *args, **kwargs)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._watch(self.tokenizer.encode_batch, *args, **kwargs)

    def _watch(self, encode: Any, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        try:
            return encode(*args, **kwargs)
        finally:
            self.ended.set()


async def test_health_stays_responsive_while_a_large_tokenize_runs(server: Live) -> None:
    (worker,) = [a for a in server.engine.actors if isinstance(a, TokenizerActor)]
    watched = Watched(worker.tokenizer)
    word = "a" * (16 * CONTEXT)  # the longest prompt allowed: seconds in the tokenizer
    worker.prompts.tokenizer = watched
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
            big = asyncio.create_task(http.post("/v1/tokenize", json={"prompt": word}))
            assert await asyncio.to_thread(watched.started.wait, 60)
            health = await http.get("/health")
            during = not watched.ended.is_set()
            tokens = (await big).json()
    finally:
        worker.prompts.tokenizer = watched.tokenizer
    # /health was answered while the tokenizer was still encoding, not after it.
    assert health.status_code == 200 and during
    assert tokens["count"] == len(tokens["tokens"]) == len(word)
