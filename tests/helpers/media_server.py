"""A small HTTP/1.1 server on 127.0.0.1 for the media fetcher's tests: routes are coroutines
that write a raw response (so a test can lie in Content-Length, drip bytes or never stop), and
the server records every request's path and headers and how many bytes each route sent."""

from __future__ import annotations

import asyncio
import io
import ssl
import struct
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Route = Callable[["Reply"], Awaitable[None]]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]


@dataclass
class Reply:
    """What a route writes to; counts body bytes per path."""

    writer: asyncio.StreamWriter
    path: str
    sent: Counter[str]

    async def head(self, status: str, headers: dict[str, str]) -> None:
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        self.writer.write("\r\n".join(lines).encode())
        await self.writer.drain()

    async def body(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()
        self.sent[self.path] += len(data)


@dataclass
class MediaServer:
    routes: dict[str, Route] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    async def start(self, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        await self.settle()
        for task in list(self._tasks):  # a route still writing to a client that never left
            task.cancel()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until every connection's route has ended (the client hung up)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the fetcher hung up: what several tests want
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").split("\r\n")
        path = request_line.split(" ")[1]
        headers = {
            k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines if ln)
        }
        self.seen.append(Seen(path, headers))
        route = self.routes.get(path, not_found)
        await route(Reply(writer, path, self.sent))


async def not_found(reply: Reply) -> None:
    await reply.head("404 Not Found", {"Content-Length": "0"})


def serve_bytes(data: bytes, **extra: str) -> Route:
    async def route(reply: Reply) -> None:
        headers = {"Content-Type": "image/png", "Content-Length": str(len(data))}
        headers.update({k.replace("_", "-"): v for k, v in extra.items()})
        await reply.head("200 OK", headers)
        await reply.body(data)

    return route


def redirect(location: str, status: str = "302 Found") -> Route:
    async def route(reply: Reply) -> None:
        await reply.head(status, {"Location": location, "Content-Length": "0"})

    return route


def endless(total: int, chunk: int, *, length: bool) -> Route:
    """`total` bytes in `chunk`-sized writes, announced in Content-Length or chunked."""

    async def route(reply: Reply) -> None:
        framing = {"Content-Length": str(total)} if length else {"Transfer-Encoding": "chunked"}
        await reply.head("200 OK", framing)
        block = b"\0" * chunk
        for _ in range(total // chunk):
            frame = block if length else b"%x\r\n%s\r\n" % (chunk, block)
            await reply.body(frame)

    return route


def drip(total: int, every_s: float) -> Route:
    """A byte every `every_s` seconds: each read is quick, the whole body is not."""

    async def route(reply: Reply) -> None:
        await reply.head("200 OK", {"Content-Length": str(total)})
        for _ in range(total):
            await reply.body(b"\0")
            await asyncio.sleep(every_s)

    return route


def png_bytes(width: int = 4, height: int = 3) -> bytes:
    """A real, decodable PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A few-byte PNG whose header claims width x height RGB pixels (its IDAT holds one row):
    what a decompression bomb looks like before anything decodes it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" + b"\0" * 3 * min(width, 64))
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )
