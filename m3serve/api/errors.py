"""HTTP errors in OpenAI's shape, and reading a request body into a typed request.

Every refusal is raised as `APIError` before a response starts, so a client gets a status code
and `{"error": {"message", "type", "param", "code"}}` — never a half-written stream.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse

from m3serve.api import wire

T = TypeVar("T")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "overloaded_error",
}


CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never received


class ClientGone(Exception):
    """The client disconnected before the response was ready: answered 499, for the access log
    and the request metrics (nobody receives it)."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.headers)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def overloaded(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": "1"})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode(body: bytes, kind: type[T]) -> T:
    """JSON -> a typed request; malformed JSON, wrong types and values the engine's wire cannot
    carry (integers beyond 64 bits, deep nesting) are 400s naming the field."""
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        value = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise APIError(400, f"invalid request: {exc}", match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, f"the body is nested deeper than {wire.MAX_DEPTH} levels") from exc
    found = wire.problem(value)
    if found is not None:
        raise APIError(400, *found)
    return value
