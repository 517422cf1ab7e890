"""Errors through the `openai` SDK and plain httpx: API keys, malformed bodies, limits, all in
OpenAI's error shape.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers.sdk_server import MAX_REQUEST_BYTES, Server

from .sdk_cases import PROMPT, assert_openai_error, chat

# ---------------------------------------------------------------------- errors


def test_wrong_api_key_raises_authentication_error(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.models.list()
        assert caught.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=server.model, messages=PROMPT, max_tokens=1)


def test_missing_api_key_is_401_in_openai_error_shape(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": PROMPT})
    assert_openai_error(response, 401)
    assert response.json()["error"]["type"] == "authentication_error"
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401)


def test_health_needs_no_api_key(server: Server) -> None:
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', None),
        (b"not json at all", None),
        (b"", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', None),
    ],
    ids=[
        "truncated",
        "not-json",
        "empty",
        "temperature-str",
        "max-tokens-str",
        "messages-str",
        "role",
    ],
)
def test_malformed_json_and_wrong_types_are_400_in_openai_error_shape(
    http: httpx.Client, body: bytes, param: str | None
) -> None:
    response = http.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, 400, param)
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_empty_messages_raise_bad_request(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=server.model, messages=[], max_tokens=1)
    assert caught.value.body["param"] == "messages"


def test_max_tokens_beyond_the_context_raise_bad_request(
    client: openai.OpenAI, server: Server
) -> None:
    context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, server, max_tokens=context + 1)
    assert "context length" in caught.value.body["message"]


def test_body_over_the_request_limit_is_413(client: openai.OpenAI, server: Server) -> None:
    huge = [{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=server.model, messages=huge, max_tokens=1)
    assert caught.value.status_code == 413
    assert str(MAX_REQUEST_BYTES) in caught.value.body["message"]


def test_body_just_under_the_limit_is_served(client: openai.OpenAI, server: Server) -> None:
    # The limit is on bytes: padding in an ignored field brings the body close to it.
    padding = "x" * (MAX_REQUEST_BYTES - 1024)
    response = chat(client, server, max_tokens=1, extra_body={"padding": padding})
    assert response.usage.completion_tokens == 1


def test_unknown_request_fields_are_ignored(client: openai.OpenAI, server: Server) -> None:
    response = chat(
        client,
        server,
        extra_body={"frobnicate": True, "vendor_options": {"x": [1, 2]}, "metadata": None},
    )
    plain = chat(client, server)
    assert response.choices[0].message.content == plain.choices[0].message.content
