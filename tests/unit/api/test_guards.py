"""The guards in front of every route (api/guards.py), with a scripted engine: a body must be
JSON (415), must not stall (408), and a client that leaves mid-body is one 499 log line; the
Host header is checked against --allowed-hosts."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from starlette.types import ASGIApp, Message

from m3serve.api.guards import host_allowed
from m3serve.runtime.config import ApiArgs

from .test_http_errors import MESSAGES, assert_openai_error, hello, request_counts

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": MESSAGES}).encode()


async def drive(app: ASGIApp, parts: list[Message], headers: dict[str, str]) -> list[Message]:
    """POST /v1/chat/completions over raw ASGI: `receive` returns `parts` in turn and then
    waits forever, as a client that sent them and went quiet. Returns what the app sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "scheme": "http",
        "server": ("test", 80),
        "client": ("127.0.0.1", 1234),
        "root_path": "",
    }
    pending = list(parts)
    sent: list[Message] = []

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


def status_of(sent: list[Message]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


JSON_HEADERS = {"content-type": "application/json", "content-length": str(len(BODY))}


# ---------------------------------------------------------------------- media type


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/xml"]
)
async def test_a_body_that_is_not_declared_json_is_415(serve, content_type) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    async with serve(hello) as s:
        response = await s.client.post(CHAT, content=BODY, headers=headers)
        assert s.engine.seen == []
    error = assert_openai_error(response, 415, "invalid_request_error")
    assert "application/json" in error["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", "application/json;"]
)
async def test_json_with_parameters_or_any_case_is_accepted(serve, content_type) -> None:
    async with serve(hello) as s:
        response = await s.client.post(CHAT, content=BODY, headers={"content-type": content_type})
    assert response.status_code == 200, response.text


async def test_a_post_without_a_body_needs_no_content_type(serve) -> None:
    async with serve(hello) as s:
        models = await s.client.post("/v1/models")
        chat = await s.client.post(CHAT)
    assert models.status_code == 405  # the route's answer, not the guard's
    assert_openai_error(chat, 400, "invalid_request_error")


# ---------------------------------------------------------------------- stalls and hang-ups


async def test_a_body_shorter_than_its_content_length_times_out_with_408(serve) -> None:
    async with serve(hello, ApiArgs(request_body_timeout=0.2)) as s:
        part = {"type": "http.request", "body": BODY[:10], "more_body": True}
        sent = await drive(s.app, [part], JSON_HEADERS)
        assert s.engine.seen == []
    assert status_of(sent) == 408
    body = json.loads(
        b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    )
    assert body["error"]["code"] == 408


async def test_a_slow_body_that_keeps_coming_is_read(serve) -> None:
    # The timeout is per piece, as nginx's client_body_timeout: a slow upload is not a stall.
    async with serve(hello, ApiArgs(request_body_timeout=5.0)) as s:
        parts = [
            {"type": "http.request", "body": BODY[i : i + 7], "more_body": i + 7 < len(BODY)}
            for i in range(0, len(BODY), 7)
        ]
        sent = await drive(s.app, parts, JSON_HEADERS)
    assert status_of(sent) == 200


async def test_a_client_leaving_mid_body_is_one_499_line_without_a_traceback(
    serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with serve(hello) as s:
        parts = [
            {"type": "http.request", "body": BODY[:10], "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent = await drive(s.app, parts, JSON_HEADERS)
        metrics = (await s.client.get("/metrics")).text
        assert s.engine.seen == []
    assert status_of(sent) == 499
    lines = [r for r in caplog.records if "499" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert CHAT in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert request_counts(metrics)[(CHAT, "499")] == 1


# ---------------------------------------------------------------------- Host


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost", True),
        ("localhost:30000", True),
        ("LOCALHOST:30000", True),
        ("127.0.0.1:8080", True),
        ("[::1]:30000", True),
        ("api.example.com", True),
        ("deep.api.example.com", True),
        ("example.com", False),
        ("evil.com", False),
        ("localhost.evil.com", False),
        ("", False),
    ],
)
def test_hosts_match_names_ips_and_subdomain_wildcards(host: str, allowed: bool) -> None:
    patterns = ["localhost", "127.0.0.1", "::1", "*.example.com"]
    assert host_allowed(host, patterns) is allowed


async def test_a_host_outside_allowed_hosts_is_400(serve) -> None:
    args = ApiArgs(allowed_hosts=["localhost", "127.0.0.1"])
    async with serve(hello, args) as s:
        evil = await s.post(CHAT, {"messages": MESSAGES}, headers={"host": "evil.example"})
        local = await s.post(CHAT, {"messages": MESSAGES}, headers={"host": "localhost:30000"})
        health = await s.client.get("/health", headers={"host": "evil.example"})
        assert len(s.engine.seen) == 1
    error = assert_openai_error(evil, 400, "invalid_request_error")
    assert "evil.example" in error["message"]
    assert local.status_code == 200
    assert health.status_code == 400  # a rebinding page must not even probe the server


async def test_without_allowed_hosts_any_host_is_served(serve) -> None:
    async with serve(hello, ApiArgs()) as s:
        response = await s.post(CHAT, {"messages": MESSAGES}, headers={"host": "anything.test"})
    assert response.status_code == 200
