"""Operational endpoints: /health, /metrics, /v1/models, /v1/tokenize, /v1/detokenize and
/openapi.json (generated from the request structs)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3serve.api.errors import APIError, decode, read_body
from m3serve.api.metrics import CONTENT_TYPE
from m3serve.api.protocol import REQUEST_TYPES, DetokenizeRequest, TokenizeRequest, to_builtins
from m3serve.api.state import ServerState
from m3serve.engine import EngineDeadError, RequestError
from m3serve.engine.media import MediaRefused, load_media
from m3serve.runtime.messages import MediaBlob

T = TypeVar("T")


async def health(request: Request) -> Response:
    state: ServerState | None = getattr(request.app.state, "server", None)
    reason = "starting" if state is None else state.engine.unavailable
    if reason is not None:
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(state.engine.metrics), media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(request: Request) -> Response:
    state: ServerState = request.app.state.server
    name = request.path_params["name"]
    if name != state.model_name:
        raise APIError(
            404, f"model {name!r} does not exist (this server serves {state.model_name!r})"
        )
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "m3serve",
        "root": state.engine.info.get("model_path"),
        "max_model_len": state.context_length,
    }


async def tokenize(request: Request) -> Response:
    """Encoded by a tokenizer worker: a big prompt never stalls this process's event loop. A
    message's images and videos count as the placeholder runs generation would see."""
    state: ServerState = request.app.state.server
    body = decode(await read_body(request, state.args.max_request_bytes), TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", "prompt")
    messages, media = None, None
    if body.messages is not None:
        messages, media = await _load_media([to_builtins(m) for m in body.messages], state)
    call = state.engine.tokenize(body.prompt, messages, body.add_generation_prompt, media)
    ids = await _in_worker(call, "prompt" if messages is None else "messages")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.context_length})


async def _load_media(
    messages: list[dict[str, Any]], state: ServerState
) -> tuple[list[dict[str, Any]], list[MediaBlob]]:
    """The messages' image/video parts loaded as chat loads them (every part checked before any
    is fetched), so the worker expands their placeholders to the ids generation sees."""
    try:
        return await load_media(messages, state.engine.args.media)
    except MediaRefused as exc:
        raise APIError(400, exc.message, exc.param) from exc


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = decode(await read_body(request, state.args.max_request_bytes), DetokenizeRequest)
    text = await _in_worker(state.engine.detokenize(body.tokens), "tokens")
    return JSONResponse({"prompt": text})


async def _in_worker(call: Awaitable[T], param: str) -> T:
    """A tokenizer worker's answer; its refusal is an APIError naming `param`."""
    try:
        return await call
    except RequestError as exc:
        raise APIError(exc.code, str(exc), param) from exc
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not available: {exc}") from exc


def openapi_document(title: str, api_key: bool) -> dict[str, Any]:
    """OpenAPI 3.1 for every POST endpoint, schemas straight from the request structs."""
    (schemas, components) = msgspec.json.schema_components(
        list(REQUEST_TYPES.values()), ref_template="#/components/schemas/{name}"
    )
    components["Error"] = _ERROR_SCHEMA
    errors = {
        str(code): {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code, text in (
            (400, "Bad request"),
            (401, "Unauthorized"),
            (408, "Body stalled"),
            (413, "Too large"),
            (415, "Not JSON"),
        )
    }
    paths: dict[str, Any] = {}
    for (path, _), schema in zip(REQUEST_TYPES.items(), schemas, strict=True):
        paths[path] = {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                "responses": {"200": {"description": "OK"}, **errors},
            }
        }
    for path in ("/v1/models", "/health", "/metrics"):
        paths[path] = {"get": {"responses": {"200": {"description": "OK"}}}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
