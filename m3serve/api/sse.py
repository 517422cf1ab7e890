"""Server-sent events on the wire: `data: <json>` frames (named by an `event:` line for the
Responses API), the in-band error frame, the closing `[DONE]`, and the response that carries
them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

# Characters that JSON leaves raw in strings but that Python's str.splitlines() (and so httpx's
# `iter_lines`, which many SSE clients read with) takes for line ends: raw, a token of model
# text that holds one splits its event in two. Escaped, the JSON value is the same.
# (UTF-8 of U+0085, U+2028, U+2029; a lead byte starts each, so none is part of another.)
_LINE_ENDS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def event(payload: dict[str, Any]) -> bytes:
    data = orjson.dumps(payload)
    for raw, escaped in _LINE_ENDS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def named_event(payload: dict[str, Any]) -> bytes:
    """A Responses API frame: an `event:` line with the payload's type, then its data."""
    return b"event: " + payload["type"].encode() + b"\n" + event(payload)


def error_event(message: str, code: int) -> bytes:
    """An error after the response started: the status code is long sent, so it goes in-band."""
    return event({"error": {"message": message, "type": "server_error", "code": code}})


class EventStream(StreamingResponse):
    """SSE response that closes its generator as soon as the response ends, also when the
    client hung up: the generator's cleanup aborts the engine requests, so the KV is freed now
    rather than whenever the garbage collector finalizes the generator."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
