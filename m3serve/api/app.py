"""The Starlette application: routes, error mapping, the middlewares (request counting, the
Host and body guards of `guards.py`, the Bearer key) and the engine's lifecycle when the app
owns it.

`create_app(engine)` embeds the API around an engine you manage; `create_app(engine,
own_engine=True)` starts it with the app and shuts it down with it (what `m3serve serve` does).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from m3serve.api import admin
from m3serve.api.api_key import read_api_key
from m3serve.api.chat import chat_completions
from m3serve.api.completions import completions
from m3serve.api.errors import CLIENT_CLOSED, APIError, ClientGone, error_response
from m3serve.api.guards import AllowedHosts, GuardBody
from m3serve.api.metrics import ServerMetrics
from m3serve.api.responses import responses
from m3serve.api.state import ServerState
from m3serve.engine.async_engine import AsyncEngine, EngineDeadError, RequestError
from m3serve.runtime.config import ApiArgs

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})


def create_app(
    engine: AsyncEngine, args: ApiArgs | None = None, own_engine: bool = False
) -> Starlette:
    args = args or engine.args.api
    api_key = read_api_key(args)
    metrics = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if own_engine:
            await engine.start()
        app.state.server = ServerState.build(engine, args, metrics)
        log.info("serving %s", app.state.server.model_name)
        try:
            yield
        finally:
            if own_engine:
                await engine.shutdown()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", admin.models, methods=["GET"]),
        Route("/v1/models/{name:path}", admin.model, methods=["GET"]),
        Route("/v1/tokenize", admin.tokenize, methods=["POST"]),
        Route("/v1/detokenize", admin.detokenize, methods=["POST"]),
        Route("/health", admin.health, methods=["GET"]),
        Route("/metrics", admin.metrics, methods=["GET"]),
    ]
    doc = admin.openapi_document("m3serve", api_key is not None)

    async def openapi(_: Request) -> Response:
        return JSONResponse(doc)

    routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            ClientGone: _client_gone,
            RequestError: _engine_failed,
            EngineDeadError: _engine_failed,
            404: _not_found,
            405: _not_allowed,
            Exception: _internal,
        },
    )
    # The last added runs first: requests are counted outside every check, so refusals count;
    # the Host is checked before the key, the key before the body is read.
    app.add_middleware(GuardBody, limit=args.max_request_bytes, timeout=args.request_body_timeout)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    if args.allowed_hosts is not None:
        app.add_middleware(AllowedHosts, hosts=args.allowed_hosts)
    app.add_middleware(CountRequests, metrics=metrics)
    return app


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    # One line, no traceback: a client that hangs up is not a server error.
    log.info("%s %s: %s (%d)", request.method, request.url.path, exc, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


async def _engine_failed(_: Request, exc: Exception) -> Response:
    # A non-streamed request the engine failed while it ran (a dead engine, a shutdown's
    # deadline): the engine's status and words, not a bare 500.
    code = exc.code if isinstance(exc, RequestError) else 503
    return error_response(code, str(exc))


async def _not_found(request: Request, _: Exception) -> Response:
    return error_response(404, f"no route {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    headers = getattr(exc, "headers", None)  # Starlette's 405 carries the Allow header
    return error_response(
        405, f"{request.method} is not allowed on {request.url.path}", None, headers
    )


async def _internal(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")


class RequireApiKey:
    """Lets a request through only if it carries `Authorization: Bearer <key>` (compared in
    constant time) or goes to one of `OPEN_PATHS`; any other gets a 401 in OpenAI's error shape.
    Plain ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key (Authorization: Bearer)")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class CountRequests:
    """Counts every HTTP request by endpoint and response status (`observe_request`), except
    the scrapes `/metrics` answers. Plain ASGI, so streaming responses pass through untouched; a
    request that fails before its response starts counts as 500, the status the client gets."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status: dict[str, Any] = {}

        async def record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            code = status.get("code", 500)
            # The scraper's own requests would only count themselves; a refused one (wrong key)
            # is worth seeing.
            if path != "/metrics" or code != 200:
                self.metrics.observe_request(_endpoint(path), code)


def _endpoint(path: str) -> str:
    # Unknown paths share one label, so scanners cannot blow up the metric's cardinality.
    known = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"}
    known |= {"/v1/tokenize", "/v1/detokenize", "/health", "/openapi.json"}
    return path if path in known else "other"
