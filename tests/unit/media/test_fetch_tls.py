"""https media: the connection goes to the checked address while TLS still speaks to the name —
SNI carries it and the certificate is verified against it, not against the address."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.media_server import MediaServer, png_bytes, serve_bytes
from helpers.tls_cert import self_signed, server_context

from m3serve.media import MediaError, MediaPolicy, fetch_media

PNG = png_bytes()


@pytest.fixture
async def tls_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[MediaServer, list[str]]]:
    """A TLS server whose certificate names `request.param`, trusted through SSL_CERT_FILE."""
    cert, key = self_signed(request.param, tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    sni: list[str] = []
    srv = MediaServer()
    srv.routes["/cat.png"] = serve_bytes(PNG)
    await srv.start(tls=server_context(cert, key, sni))
    yield srv, sni
    await srv.close()


def policy() -> MediaPolicy:
    return MediaPolicy.from_values(max_bytes=1 << 20, timeout_s=5.0, allowed_domains="images.test")


@pytest.mark.parametrize("tls_server", ["images.test"], indirect=True)
async def test_https_to_the_pinned_address_keeps_the_name_in_sni_and_host(
    tls_server: tuple[MediaServer, list[str]], fake_dns
) -> None:
    server, sni = tls_server
    lookups = fake_dns({"images.test": ["127.0.0.1"]})
    url = f"https://images.test:{server.port}/cat.png"
    assert await fetch_media(url, policy()) == PNG
    assert sni == ["images.test"]
    assert server.seen[0].headers["host"] == f"images.test:{server.port}"
    assert lookups["images.test"] == 1


@pytest.mark.parametrize("tls_server", ["other.test"], indirect=True)
async def test_https_certificate_for_another_name_is_refused(
    tls_server: tuple[MediaServer, list[str]], fake_dns
) -> None:
    server, _ = tls_server
    fake_dns({"images.test": ["127.0.0.1"]})
    with pytest.raises(MediaError, match=r"could not fetch media from 'images\.test'"):
        await fetch_media(f"https://images.test:{server.port}/cat.png", policy())
    assert server.seen == []
