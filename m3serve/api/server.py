"""`m3serve serve`: the API app on uvicorn (uvloop), owning its engine."""

from __future__ import annotations

import contextlib
import logging

from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.runtime.config import ServerArgs

log = logging.getLogger(__name__)


def serve(args: ServerArgs) -> None:
    import uvicorn

    args.check_supported()  # refuse before anything starts, listing every setting at once
    app = create_app(AsyncEngine(args), args.api, own_engine=True)
    config = uvicorn.Config(
        app,
        host=args.api.host,
        port=args.api.port,
        loop="uvloop",
        http="h11",
        lifespan="on",
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        # The access log has paths and status codes only, never bodies or headers.
        access_log=True,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    log.info("starting m3serve on http://%s:%d", args.api.host, args.api.port)
    # uvicorn re-raises the Ctrl-C it already handled with a graceful shutdown.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
