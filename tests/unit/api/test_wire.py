"""Values the engine's wire cannot carry (api/wire.py): integers beyond 64 bits and JSON nested
deeper than MAX_DEPTH are 400s in OpenAI's shape naming the field, never 500s from the codec or
a RecursionError — on every endpoint, before the engine sees the request."""

from __future__ import annotations

import json

import pytest

from m3serve.api import wire
from m3serve.api.protocol import ChatCompletionRequest

from .test_http_errors import MESSAGES, assert_openai_error, hello

BIG = 2**64
CASES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": BIG}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -BIG}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "stop_token_ids": [1, BIG]},
        "stop_token_ids[1]",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "chat_template_kwargs": {"x": [0.5, BIG]}},
        "chat_template_kwargs.x[1]",
    ),
    ("/v1/completions", {"prompt": "Hi", "top_k": BIG}, "top_k"),
    ("/v1/completions", {"prompt": [[1, 2], [3, BIG]]}, "prompt[1][1]"),
    ("/v1/detokenize", {"tokens": [BIG]}, "tokens[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES)
async def test_an_integer_beyond_64_bits_is_a_400_naming_it(serve, path, body, param) -> None:
    async with serve(hello) as s:
        response = await s.post(path, body)
        assert s.engine.seen == []
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    assert "64 bits" in error["message"]


@pytest.mark.parametrize("depth", [wire.MAX_DEPTH, 1000, 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
async def test_json_nested_too_deep_is_a_400(serve, path, depth) -> None:
    nested = "[" * depth + "]" * depth
    raw = f'{{"messages": {json.dumps(MESSAGES)}, "chat_template_kwargs": {{"x": {nested}}}}}'
    if path == "/v1/tokenize":
        raw = (
            f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "x": {nested}}}]}}]}}'
        )
    async with serve(hello) as s:
        response = await s.client.post(
            path, content=raw, headers={"content-type": "application/json"}
        )
        health = await s.client.get("/health")
        assert s.engine.seen == []
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert "nested deeper" in error["message"]
    assert health.status_code == 200


def test_the_limits_are_exact() -> None:
    body = ChatCompletionRequest(messages=[], seed=2**63 - 1, stop_token_ids=[-(2**63)])
    assert wire.problem(body) is None
    assert wire.problem([2**63]) is not None
    assert wire.problem([-(2**63) - 1]) is not None
    deepest: list = []
    for _ in range(wire.MAX_DEPTH - 1):
        deepest = [deepest]
    assert wire.problem(deepest) is None  # MAX_DEPTH levels, counting the outermost
    assert wire.problem([deepest]) is not None


@pytest.mark.parametrize(
    "items",
    [[1, 2, BIG], [BIG, 1.5, 3], [1e300, BIG, 5], ["a", BIG], [[1], [BIG]], [True, BIG]],
    ids=["ints", "int-extreme", "float-extreme", "mixed", "nested", "bools"],
)
def test_a_big_integer_is_found_in_any_list(items: list) -> None:
    assert wire.problem({"x": items}) is not None
