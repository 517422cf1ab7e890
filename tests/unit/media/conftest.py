"""The media tests' local HTTP server and a resolver that maps test names to 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable

import pytest
from helpers.media_server import MediaServer


@pytest.fixture
async def server() -> AsyncIterator[MediaServer]:
    srv = MediaServer()
    await srv.start()
    yield srv
    await srv.close()


FakeDns = Callable[[dict[str, list[str]]], Counter[str]]


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> FakeDns:
    """`fake_dns({"images.test": ["127.0.0.1"]})` makes the running loop resolve those names
    to those addresses (other names as usual) and returns a counter of lookups per name."""

    def install(answers: dict[str, list[str]]) -> Counter[str]:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo
        lookups: Counter[str] = Counter()

        async def getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
            name = host.decode() if isinstance(host, bytes) else host
            if name not in answers:
                return await real(host, port, *args, **kwargs)
            lookups[name] += 1
            return [
                (
                    socket.AF_INET6 if ":" in ip else socket.AF_INET,
                    socket.SOCK_STREAM,
                    socket.IPPROTO_TCP,
                    "",
                    (ip, port or 0),
                )
                for ip in answers[name]
            ]

        monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
        return lookups

    return install
