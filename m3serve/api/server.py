"""`m3serve serve`: the API app on uvicorn (uvloop) around its engine, and the server's life.

- The port is taken before the model loads, so a port in use is a one-line error at once.
- A dead engine makes the server exit non-zero, so that an outside supervisor restarts it; its
  requests have already failed (a 503, in-band for a stream) and /health answers 503.
- SIGTERM or Ctrl-C drains: /health and new requests get 503, running requests get
  `--graceful-shutdown-timeout` seconds, the rest end with an error (and `[DONE]` for a stream),
  then the server exits 0. A second signal ends the running requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any

import uvicorn

from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.heap import freeze_heap

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLOSING = "the server is shutting down"


class PortUnavailable(RuntimeError):
    """The HTTP port cannot be bound (in use, or not ours to take)."""


def serve(args: ServerArgs) -> int:
    """Run the server until a signal stops it (returns 0); raises `EngineDeadError` if the
    engine died."""
    args.check_supported()  # refuse before anything starts, listing every setting at once
    sock = bind(args.api.host, args.api.port)
    log.info("starting m3serve on http://%s:%d", args.api.host, args.api.port)
    try:
        return _run(_serve(args, sock))
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet: until the engine is up, connections are
    refused rather than left waiting)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc}") from None
    # As uvicorn does: a restarted server may rebind while old connections sit in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(args: ServerArgs, sock: socket.socket) -> int:
    engine = AsyncEngine(args)
    loop = asyncio.get_running_loop()
    # A signal during start-up stops the start; the engine cleans up what it started.
    starting = asyncio.ensure_future(engine.start())
    for sig in SIGNALS:
        loop.add_signal_handler(sig, starting.cancel)
    try:
        await starting
    except asyncio.CancelledError:
        if not starting.cancelled():
            raise
        log.info("stopped during start-up")
        return 0
    server = Server(_uvicorn_config(args, engine), engine, args.runtime.graceful_shutdown_timeout)
    freeze_heap("api")  # `m3serve serve` owns this process
    for sig in SIGNALS:
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    watcher = asyncio.create_task(server.exit_if_engine_dies())
    log.info("ready on http://%s:%d", args.api.host, args.api.port)
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        await engine.shutdown()
    if engine.dead is not None:
        raise engine.dead
    return 0


def _uvicorn_config(args: ServerArgs, engine: AsyncEngine) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(engine, args.api),
        host=args.api.host,
        port=args.api.port,
        loop="uvloop",
        http="h11",
        lifespan="on",
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        # The access log has paths and status codes only, never bodies or headers.
        access_log=True,
        # After the drain every stream has ended; this only bounds slow connections.
        timeout_graceful_shutdown=5,
    )


class Server(uvicorn.Server):
    """uvicorn's server, stopped m3serve's way: a signal drains the engine before uvicorn closes
    the listener and its connections; a dead engine stops it with exit code 1."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._drain: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The loop's signal handlers (set in _serve) call handle_exit. uvicorn's own would stop
        # without a drain and re-raise the signal afterwards: an exit status of 143 on SIGTERM.
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self._drain is None:
            log.info(
                "%s: refusing new requests; running ones have %gs to finish", name, self.grace_s
            )
            self.engine.stop_admitting(CLOSING)
            self._drain = asyncio.ensure_future(self._drain_then_exit(self.grace_s))
        elif not self.should_exit:
            log.warning("%s again: ending the running requests now", name)
            self._drain.cancel()
            self._drain = asyncio.ensure_future(self._drain_then_exit(0.0))
        else:
            self.force_exit = True

    async def _drain_then_exit(self, grace_s: float) -> None:
        cut = await self.engine.drain(grace_s)
        if cut:
            log.warning("ended %d request(s) still running after %gs", cut, grace_s)
        self.should_exit = True

    async def exit_if_engine_dies(self) -> None:
        await self.engine.died.wait()
        log.error("the engine is dead: stopping the server (exit code 1) for a restart")
        self.should_exit = True
