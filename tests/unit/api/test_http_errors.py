"""The HTTP surface around the handlers, with a scripted engine: Bearer auth, OpenAI-shaped
errors for every refusal, body limits, request decoding, /openapi.json, /health, engine errors
and /metrics."""

from __future__ import annotations

import hmac
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers.scripted_engine import ScriptedEngine

from m3serve.api import app as app_module
from m3serve.api.metrics import CONTENT_TYPE
from m3serve.engine.async_engine import EngineDeadError, RequestError
from m3serve.runtime.config import ApiArgs
from m3serve.runtime.messages import GenerateReq

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
KEY = "sk-test-0123456789"
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/v1/detokenize"]


def hello(req: GenerateReq) -> list[str]:
    return ["Hello", "!"]


def assert_openai_error(response: Any, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    return error


def request_counts(metrics: str) -> dict[tuple[str, str], float]:
    pattern = r'm3serve:request_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)'
    return {(e, s): float(v) for e, s, v in re.findall(pattern, metrics)}


# ---------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer "},
    ],
    ids=["missing", "wrong", "basic", "no-scheme", "longer", "empty"],
)
async def test_requests_without_the_right_bearer_key_are_401(serve, headers) -> None:
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        chat = await s.post(CHAT, {"messages": MESSAGES}, headers=headers)
        models = await s.client.get("/v1/models", headers=headers)
        assert s.engine.seen == []
    for response in (chat, models):
        assert_openai_error(response, 401, "authentication_error")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_right_bearer_key_is_let_in(serve, scheme) -> None:
    headers = {"Authorization": f"{scheme} {KEY}"}
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        chat = await s.post(CHAT, {"messages": MESSAGES}, headers=headers)
        models = await s.client.get("/v1/models", headers=headers)
    assert chat.status_code == 200
    assert chat.json()["choices"][0]["message"]["content"] == "Hello!"
    assert models.status_code == 200


async def test_health_is_open_without_a_key(serve) -> None:
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        health = await s.client.get("/health")
        metrics = await s.client.get("/metrics")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    assert metrics.status_code == 401


async def test_the_key_is_compared_in_constant_time(serve, monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        wrong = await s.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await s.client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert (wrong.status_code, right.status_code) == (401, 200)
    assert calls == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode())]


async def test_without_a_key_every_endpoint_is_open(serve) -> None:
    async with serve(hello, ApiArgs()) as s:
        response = await s.client.get("/v1/models")
    assert response.status_code == 200
    (card,) = response.json()["data"]
    assert card["object"] == "model"
    assert card["max_model_len"] == 4096


# ---------------------------------------------------------------------- error shapes


async def test_unknown_paths_are_openai_404s(serve) -> None:
    async with serve(hello) as s:
        response = await s.client.get("/v1/engines")
    error = assert_openai_error(response, 404, "not_found_error")
    assert "/v1/engines" in error["message"]


async def test_a_wrong_method_is_an_openai_405_with_allow(serve) -> None:
    async with serve(hello) as s:
        response = await s.client.get(CHAT)
    error = assert_openai_error(response, 405, "invalid_request_error")
    assert "GET" in error["message"]
    # RFC 9110 §15.5.6: a 405 response MUST carry the methods the resource supports.
    assert response.headers.get("allow") == "POST"


async def test_a_declared_content_length_over_the_limit_is_413(serve) -> None:
    async with serve(hello, ApiArgs(max_request_bytes=1024)) as s:
        body = {"messages": [{"role": "user", "content": "x" * 2000}]}
        response = await s.post(CHAT, body)
        assert s.engine.seen == []
    error = assert_openai_error(response, 413, "invalid_request_error")
    assert "1024" in error["message"]


async def test_a_chunked_body_over_the_limit_is_413(serve) -> None:
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(100):
            sent.append(1)
            yield b"x" * 100
        yield b'"}]}'

    async with serve(hello, ApiArgs(max_request_bytes=1024)) as s:
        response = await s.client.post(
            CHAT, content=chunks(), headers={"content-type": "application/json"}
        )
        assert s.engine.seen == []
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_openai_error(response, 413, "invalid_request_error")
    assert len(sent) < 100  # refused before the whole body was read


async def test_a_body_just_under_the_limit_is_read(serve) -> None:
    async with serve(hello, ApiArgs(max_request_bytes=1024)) as s:
        body = {"messages": [{"role": "user", "content": "x" * 900}]}
        response = await s.post(CHAT, body)
    assert response.status_code == 200


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"messages": [', b"", b"\xff\xfe", b"null", b"[1, 2]", b'"text"'],
    ids=["garbage", "truncated", "empty", "bad-utf8", "null", "array", "string"],
)
async def test_a_body_that_is_not_a_json_object_is_400(serve, content) -> None:
    async with serve(hello) as s:
        response = await s.client.post(
            CHAT, content=content, headers={"content-type": "application/json"}
        )
    assert_openai_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": MESSAGES, "n": 1.5}, "n"),
        (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream"),
        (CHAT, {"messages": "Hi"}, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
        (CHAT, {"messages": MESSAGES, "stop": 5}, "stop"),
        (CHAT, {"messages": MESSAGES, "tool_choice": "sometimes"}, "tool_choice"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/v1/tokenize", {"prompt": 3}, "prompt"),
    ],
)
async def test_a_field_of_the_wrong_type_is_a_400_naming_it(serve, path, body, param) -> None:
    async with serve(hello) as s:
        response = await s.post(path, body)
        assert s.engine.seen == []
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"seed": -1}, "seed"),
        ({"messages": []}, "messages"),
    ],
)
async def test_an_out_of_range_field_is_a_400_naming_it(serve, body, param) -> None:
    async with serve(hello) as s:
        response = await s.post(CHAT, {"messages": MESSAGES, **body})
        assert s.engine.seen == []
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})],
)
async def test_n_zero_is_a_400_naming_n(serve, path, body) -> None:
    async with serve(hello) as s:
        response = await s.post(path, {**body, "n": 0})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == "n"


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})],
)
async def test_a_zero_max_tokens_is_a_400_naming_max_tokens(serve, path, body) -> None:
    async with serve(hello) as s:
        response = await s.post(path, {**body, "max_tokens": 0})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == "max_tokens"  # the request's name, not the engine's max_new_tokens


async def test_a_missing_required_field_is_a_400_mentioning_it(serve) -> None:
    async with serve(hello) as s:
        chat = await s.post(CHAT, {"model": "m3"})
        completion = await s.post("/v1/completions", {"model": "m3"})
    assert "messages" in assert_openai_error(chat, 400, "invalid_request_error")["message"]
    assert "prompt" in assert_openai_error(completion, 400, "invalid_request_error")["message"]


async def test_unknown_fields_are_ignored(serve) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi", "weight": 3}],
        "metadata": {"trace": "abc"},
        "store": False,
        "service_tier": "auto",
        "frobnicate": [1, {"x": None}],
    }
    async with serve(hello) as s:
        response = await s.post(CHAT, body)
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello!"
    assert req.messages == [{"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------------- openapi


async def test_openapi_lists_the_post_endpoints_with_request_schemas(serve) -> None:
    async with serve(hello) as s:
        doc = (await s.client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, name in zip(
        POST_PATHS,
        ["ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest"],
        strict=True,
    ):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"
        }
        assert name in schemas
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "securitySchemes" not in doc["components"]
    assert "security" not in doc


async def test_openapi_declares_bearer_auth_when_a_key_is_set(serve) -> None:
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        response = await s.client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    doc = response.json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]


# ---------------------------------------------------------------------- engine state


async def test_health_is_503_while_the_engine_is_unhealthy(serve, model_dir) -> None:
    engine = ScriptedEngine(hello, str(model_dir))
    async with serve(engine) as s:
        engine.healthy = False
        down = await s.client.get("/health")
        engine.dead = EngineDeadError("the scheduler process exited")
        dead = await s.client.get("/health")
        engine.healthy, engine.dead = True, None
        up = await s.client.get("/health")
    assert down.status_code == 503
    assert down.json() == {"status": "unhealthy", "reason": "not running"}
    assert dead.status_code == 503
    assert "scheduler" in dead.json()["reason"]
    assert up.status_code == 200


def refusing(exc: Exception):
    def script(req: GenerateReq) -> list[str]:
        raise exc

    return script


@pytest.mark.parametrize("stream", [False, True])
async def test_an_overloaded_engine_is_a_503_with_retry_after(serve, stream) -> None:
    async with serve(refusing(RequestError("the waiting queue is full", code=503))) as s:
        chat = await s.post(CHAT, {"messages": MESSAGES, "stream": stream})
        completion = await s.post("/v1/completions", {"prompt": "x", "stream": stream})
    for response in (chat, completion):
        error = assert_openai_error(response, 503, "overloaded_error")
        assert "queue is full" in error["message"]
        assert response.headers["retry-after"] == "1"


async def test_an_engine_refusal_keeps_its_status(serve) -> None:
    async with serve(refusing(RequestError("prompt is longer than the context", code=400))) as s:
        response = await s.post(CHAT, {"messages": MESSAGES})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert "longer than the context" in error["message"]


async def test_a_dead_engine_is_a_503(serve) -> None:
    async with serve(refusing(EngineDeadError("the engine process exited"))) as s:
        response = await s.post(CHAT, {"messages": MESSAGES, "n": 2})
    error = assert_openai_error(response, 503, "overloaded_error")
    assert "engine" in error["message"]


class FailsAfterFirst(list):
    """Script output whose iteration fails after the first piece: a mid-stream engine error."""

    def __iter__(self):
        yield self[0]
        raise RequestError("the executor failed", code=500)


async def test_an_engine_failure_mid_stream_is_reported_in_band(serve) -> None:
    async with serve(lambda req: FailsAfterFirst(["Hel", "lo"])) as s:
        events = await s.events(CHAT, {"messages": MESSAGES})
    assert events[-1] == {
        "error": {"message": "the executor failed", "type": "server_error", "code": 500}
    }
    assert events[1]["choices"][0]["delta"] == {"content": "Hel"}


# ---------------------------------------------------------------------- metrics


async def test_metrics_count_requests_by_endpoint_and_status(serve) -> None:
    async with serve(hello) as s:
        for _ in range(2):
            await s.post(CHAT, {"messages": MESSAGES})
        await s.post(CHAT, {"messages": MESSAGES, "temperature": 9})
        await s.post("/v1/completions", {"prompt": "x"})
        await s.client.get("/v1/nothing-here")
        await s.client.get("/also/not/here")
        await s.client.get("/health")
        await s.client.get("/metrics")
        response = await s.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert request_counts(response.text) == {
        ("/v1/chat/completions", "200"): 2,
        ("/v1/chat/completions", "400"): 1,
        ("/v1/completions", "200"): 1,
        ("other", "404"): 2,
        ("/health", "200"): 1,
    }
    assert 'm3serve:request_success_total{finish_reason="stop"} 3' in response.text


async def test_refused_requests_to_unknown_paths_share_one_metrics_label(serve) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with serve(hello, ApiArgs(api_key=KEY)) as s:
        await s.client.get("/wp-admin/setup.php")
        await s.client.get("/.env")
        await s.client.get("/v1/models")
        metrics = (await s.client.get("/metrics", headers=auth)).text
    assert request_counts(metrics) == {("other", "401"): 2, ("/v1/models", "401"): 1}
