"""ASGI guards in front of every route: the `Host` a request may name (`--allowed-hosts`), and
what a request body must be — JSON (else 415), at most `--max-request-bytes` (413), sent
without stalling (`--request-body-timeout`, 408) — and a client that leaves mid-body (499).

The body limits act on the ASGI messages themselves, so they hold for every endpoint however it
reads its body. Plain ASGI, so streaming responses pass through untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from m3serve.api.errors import APIError, ClientGone, error_response

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPES = frozenset({"application/json"})


class AllowedHosts:
    """Answers 400 to a request whose `Host` header matches none of `hosts`: exact names or
    IPs (any port), `*.example.com` for its subdomains, `*` for any. Starlette's
    TrustedHostMiddleware does the same, but answers in plain text."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = list(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if host_allowed(host, self.hosts):
            await self.app(scope, receive, send)
            return
        response = error_response(400, f"the Host {host!r} is not allowed here (--allowed-hosts)")
        await response(scope, receive, send)


def host_allowed(host: str, patterns: Sequence[str]) -> bool:
    name = _bare(_without_port(host))
    for pattern in map(_bare, patterns):
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def _without_port(host: str) -> str:
    if host.startswith("["):  # [::1]:30000
        return host.partition("]")[0] + "]"
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _bare(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]")


class GuardBody:
    """Refuses a request body that is not JSON or declares more than `limit` bytes before the
    route runs, and hands the route a `receive` that enforces the limit, the read timeout and
    the hang-up while the body arrives."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(Headers(scope=scope))
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, BodyReader(receive, self.limit, self.timeout), send)

    def _refusal(self, headers: Headers) -> APIError | None:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return APIError(
                413, f"request body of {declared} bytes exceeds the {self.limit}-byte limit"
            )
        has_body = "transfer-encoding" in headers or (declared or "0") != "0"
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if has_body and media_type not in JSON_TYPES:
            shown = media_type or "none"
            return APIError(415, f"the request body must be application/json, not {shown}")
        return None


class BodyReader:
    """A route's `receive` while its body arrives: each part must come within `timeout`
    seconds (408), the parts may add up to `limit` bytes (413), and a hang-up raises
    `ClientGone`. From the last part on, messages pass through untouched."""

    def __init__(self, receive: Receive, limit: int, timeout: float) -> None:
        self.receive = receive
        self.limit = limit
        self.timeout = timeout
        self.size = 0
        self.complete = False

    async def __call__(self) -> Message:
        if self.complete:
            return await self.receive()
        try:
            message = await asyncio.wait_for(self.receive(), self.timeout)
        except TimeoutError:
            raise APIError(
                408, f"the request body stalled: nothing arrived for {self.timeout:g} s"
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientGone("the client closed the connection while sending the body")
        self.size += len(message.get("body", b""))
        if self.size > self.limit:
            raise APIError(413, f"request body exceeds the {self.limit}-byte limit")
        self.complete = not message.get("more_body", False)
        return message
