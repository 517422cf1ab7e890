"""Property-based API testing: schemathesis generates requests (valid and invalid) for every
operation in `/openapi.json` and sends them to the app in-process, around the real engine in
single-process mode with the tiny checkpoint. Whatever it sends, the server must not answer 5xx.

Generated bodies are clamped (at most 8 new tokens, 2 choices, 3 prompts) so the CPU model keeps
the run short; everything else reaches the server as generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fuzz_bodies import clamp  # perf/ is on the tests' path (pyproject)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.python import asgi
from starlette.applications import Starlette

from m3serve.api.admin import openapi_document
from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.runtime.config import ApiArgs, ServerArgs

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def make_app(model_path: Path) -> Starlette:
    """The server as `m3serve serve` builds it: its lifespan starts and stops the engine."""
    args = ServerArgs.from_kwargs(
        model_path=str(model_path), single_process=True, max_total_tokens=8192
    )
    parsers = ApiArgs(reasoning_parser="minimax-m3", tool_call_parser="minimax-m3")
    return create_app(AsyncEngine(args), parsers, own_engine=True)


@pytest.fixture(scope="module")
def app(model_path: Path) -> Iterator[Starlette]:
    app = make_app(model_path)
    # Schemathesis' ASGI client runs the lifespan (so the engine) in its own event-loop thread,
    # where every generated request is then served.
    with asgi.get_client(app) as client:
        served = client.get("/openapi.json").json()
    assert app.state.server.engine.healthy
    assert served == DOCUMENT  # what the cases are generated from is what the app serves
    yield app
    asgi.shutdown_lifespans()
    assert not app.state.server.engine.healthy


# The document `/openapi.json` serves (checked in the fixture). Built here, at collection time,
# because the engine can start only once the tiny checkpoint exists (a fixture), and this
# schemathesis' lazy `from_fixture` loader does not run under pytest 9.
DOCUMENT = openapi_document("m3serve", api_key=False)
schema = schemathesis.openapi.from_dict(DOCUMENT)


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_no_request_makes_the_server_fail(app: Starlette, case: Any) -> None:
    clamp(case.path, case.body)
    response = case.call(app=app, timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}\n"
        f"body: {case.body!r}\nresponse: {response.text[:2000]}"
    )
    if response.status_code >= 400:  # every refusal is OpenAI-shaped
        error = response.json()["error"]
        assert error["code"] == response.status_code
        assert isinstance(error["message"], str)


def test_the_engine_survives_the_run(app: Starlette) -> None:
    with asgi.get_client(app) as client:
        health = client.get("/health")
        models = client.get("/v1/models")
    assert health.status_code == 200, health.text
    assert models.status_code == 200


@pytest.mark.parametrize("name", ["messages", "tools", "template"])
async def test_a_chat_template_kwarg_named_like_a_render_argument_is_refused(
    model_path: Path, name: str
) -> None:
    # One request must not be able to take the server down: today the tokenizer actor dies on
    # render_chat(..., **{"messages": ...}) ("got multiple values for argument") and every later
    # request is a 503.
    app = make_app(model_path)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client,
    ):
        bad = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "chat_template_kwargs": {name: [1, 2]}},
        )
        health = await client.get("/health")
        after = await client.post("/v1/chat/completions", json=CHAT)
    assert bad.status_code == 400, bad.text
    assert health.status_code == 200, health.text
    assert after.status_code == 200, after.text


# Any JSON value, integers of any size included, and arrays nested far past what the server
# takes (as raw text: json.dumps itself recurses).
JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**200])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
JSON_TEXTS = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
).map(json.dumps) | st.integers(60, 1500).map(lambda depth: "[" * depth + "]" * depth)
# Request fields whose value is replaced; the token budget stays at 2 so no case runs long.
FIELDS = [
    "messages", "n", "seed", "top_k", "top_p", "temperature", "stop", "stop_token_ids",
    "tools", "tool_choice", "chat_template_kwargs", "logprobs", "top_logprobs", "thinking",
    "reasoning_effort", "stream", "stream_options", "response_format", "x-unknown",
]  # fmt: skip


@given(field=st.sampled_from(FIELDS), value=JSON_TEXTS)
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_any_json_value_in_any_chat_field_is_never_a_5xx(
    app: Starlette, field: str, value: str
) -> None:
    # A repeated key (messages, max_tokens) takes the later value, as JSON decoders do.
    raw = json.dumps({**CHAT, "max_tokens": 2})[:-1] + f', "{field}": {value}}}'
    with asgi.get_client(app) as client:
        response = client.post(
            "/v1/chat/completions", data=raw.encode(), headers={"content-type": "application/json"}
        )
    assert response.status_code < 500, f"{field}={value[:200]} -> {response.text[:500]}"
