"""fetch_media over http against a real server on 127.0.0.1: refused by default and allowed when
listed, the connection pinned to the checked address, redirects re-checked and capped, bodies
capped by Content-Length and while streaming, a slow drip cut off by the total time budget."""

from __future__ import annotations

import pytest
from helpers.media_server import (
    MediaServer,
    drip,
    endless,
    png_bytes,
    png_claiming,
    redirect,
    serve_bytes,
)

from m3serve.media import MediaError, MediaPolicy, fetch_media
from m3serve.model.vision.processor import MediaDecodeError, open_image

PNG = png_bytes()
MB = 1 << 20


def policy(*allowed: str, max_bytes: int = MB, timeout_s: float = 5.0, **kw) -> MediaPolicy:
    return MediaPolicy.from_values(
        max_bytes=max_bytes, timeout_s=timeout_s, allowed_domains=list(allowed), **kw
    )


async def test_loopback_server_is_refused_by_default(server: MediaServer) -> None:
    server.routes["/cat.png"] = serve_bytes(PNG)
    with pytest.raises(MediaError, match=r"loopback address.*--allowed-media-domains"):
        await fetch_media(f"{server.url}/cat.png", policy())
    assert server.seen == []  # refused before connecting


async def test_loopback_server_is_fetched_when_listed(server: MediaServer) -> None:
    server.routes["/cat.png"] = serve_bytes(PNG)
    assert await fetch_media(f"{server.url}/cat.png", policy("127.0.0.1")) == PNG


async def test_localhost_is_fetched_when_listed(server: MediaServer) -> None:
    # localhost may resolve to ::1 first; the server listens on 127.0.0.1 only.
    server.routes["/cat.png"] = serve_bytes(PNG)
    url = f"http://localhost:{server.port}/cat.png"
    assert await fetch_media(url, policy("LOCALHOST.")) == PNG


@pytest.mark.parametrize(
    "host",
    ["2130706433", "0x7f.0.0.1", "[::ffff:127.0.0.1]", "[::1]", "0.0.0.0", "169.254.169.254"],
)
async def test_disguised_local_hosts_are_refused(host: str) -> None:
    with pytest.raises(MediaError, match=r"resolves to"):
        await fetch_media(f"http://{host}:9/x.png", policy())


async def test_metadata_hostname_is_refused_without_lookup(fake_dns) -> None:
    lookups = fake_dns({"metadata.google.internal": ["8.8.8.8"]})
    with pytest.raises(MediaError, match=r"cloud metadata"):
        await fetch_media("http://metadata.google.internal/computeMetadata/v1/", policy())
    assert lookups["metadata.google.internal"] == 0


async def test_a_name_with_one_private_answer_is_refused(fake_dns) -> None:
    fake_dns({"mixed.test": ["8.8.8.8", "127.0.0.1"]})
    with pytest.raises(MediaError, match=r"loopback"):
        await fetch_media("http://mixed.test/x.png", policy())


async def test_connection_goes_to_the_checked_address(server: MediaServer, fake_dns) -> None:
    """images.test resolves (once) to 127.0.0.1, which is allowed because the name is listed:
    reaching the local server proves the request went to that resolved address, and the
    server sees the name in Host."""
    server.routes["/cat.png"] = serve_bytes(PNG)
    lookups = fake_dns({"images.test": ["127.0.0.1"]})
    url = f"http://images.test:{server.port}/cat.png"
    assert await fetch_media(url, policy("images.test")) == PNG
    assert lookups["images.test"] == 1
    assert server.seen[0].headers["host"] == f"images.test:{server.port}"
    assert server.seen[0].headers["accept-encoding"] == "identity"


async def test_environment_proxy_is_not_used(
    server: MediaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A proxy would resolve the name itself, undoing the pin.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    server.routes["/cat.png"] = serve_bytes(PNG)
    assert await fetch_media(f"{server.url}/cat.png", policy("127.0.0.1")) == PNG


async def test_redirect_from_allowed_host_to_loopback_is_refused(
    server: MediaServer, fake_dns
) -> None:
    fake_dns({"images.test": ["127.0.0.1"]})
    server.routes["/hop"] = redirect(f"http://127.0.0.1:{server.port}/secret")
    with pytest.raises(MediaError, match=r"'127.0.0.1' resolves to a loopback address"):
        await fetch_media(f"http://images.test:{server.port}/hop", policy("images.test"))
    assert server.paths() == ["/hop"]


async def test_redirect_to_another_private_host_is_refused(server: MediaServer, fake_dns) -> None:
    fake_dns({"images.test": ["127.0.0.1"], "intranet.test": ["10.0.0.7"]})
    server.routes["/hop"] = redirect("http://intranet.test/admin")
    with pytest.raises(MediaError, match=r"'intranet.test' resolves to a private-network"):
        await fetch_media(f"http://images.test:{server.port}/hop", policy("images.test"))


@pytest.mark.parametrize("target", ["file:///etc/passwd", "data:image/png;base64,AAAA"])
async def test_redirect_off_http_is_refused(server: MediaServer, target: str) -> None:
    server.routes["/hop"] = redirect(target)
    with pytest.raises(MediaError, match=r"not followed over http|not an http"):
        await fetch_media(f"{server.url}/hop", policy("127.0.0.1"))


def chain(server: MediaServer, hops: int) -> str:
    """/r0 -> /r1 -> ... -> /r{hops} serving the PNG; relative Locations."""
    for i in range(hops):
        server.routes[f"/r{i}"] = redirect(f"/r{i + 1}", status="307 Temporary Redirect")
    server.routes[f"/r{hops}"] = serve_bytes(PNG)
    return f"{server.url}/r0"


async def test_redirects_up_to_the_cap_are_followed(server: MediaServer) -> None:
    assert await fetch_media(chain(server, 3), policy("127.0.0.1", max_redirects=3)) == PNG


async def test_no_redirects_followed_at_cap_zero(server: MediaServer) -> None:
    with pytest.raises(MediaError, match=r"redirected more than 0 times"):
        await fetch_media(chain(server, 1), policy("127.0.0.1", max_redirects=0))
    assert server.paths() == ["/r0"]


async def test_redirect_chain_longer_than_the_cap_is_refused(server: MediaServer) -> None:
    with pytest.raises(MediaError, match=r"redirected more than 3 times"):
        await fetch_media(chain(server, 4), policy("127.0.0.1", max_redirects=3))
    assert "/r4" not in server.paths()


async def test_declared_100mb_body_is_refused_unread(server: MediaServer) -> None:
    server.routes["/big"] = endless(100 * MB, MB, length=True)
    with pytest.raises(MediaError, match=f"{100 * MB} bytes.*limit of {MB}"):
        await fetch_media(f"{server.url}/big", policy("127.0.0.1"))
    await server.settle()
    assert server.sent["/big"] < 20 * MB


async def test_chunked_100mb_body_is_cut_at_the_cap(server: MediaServer) -> None:
    server.routes["/big"] = endless(100 * MB, 64 * 1024, length=False)
    with pytest.raises(MediaError, match=f"limit of {MB} bytes"):
        await fetch_media(f"{server.url}/big", policy("127.0.0.1"))
    await server.settle()
    assert server.sent["/big"] < 20 * MB


async def test_body_at_the_cap_is_accepted(server: MediaServer) -> None:
    server.routes["/exact"] = serve_bytes(PNG)
    assert await fetch_media(f"{server.url}/exact", policy("127.0.0.1", max_bytes=len(PNG)))
    with pytest.raises(MediaError, match=r"limit"):
        await fetch_media(f"{server.url}/exact", policy("127.0.0.1", max_bytes=len(PNG) - 1))


async def test_slow_drip_is_cut_off_by_the_total_timeout(server: MediaServer) -> None:
    # 1000 bytes at one per 50 ms: every read is fast, the whole would take 50 s.
    server.routes["/drip"] = drip(1000, 0.05)
    with pytest.raises(MediaError, match=r"longer than 0.5 s"):
        await fetch_media(f"{server.url}/drip", policy("127.0.0.1", timeout_s=0.5))
    await server.settle()
    assert server.sent["/drip"] < 1000


async def test_compressed_response_is_refused(server: MediaServer) -> None:
    server.routes["/gz"] = serve_bytes(b"\x1f\x8b" + b"\0" * 20, Content_Encoding="gzip")
    with pytest.raises(MediaError, match=r"'gzip'-encoded"):
        await fetch_media(f"{server.url}/gz", policy("127.0.0.1"))


async def test_error_status_is_reported(server: MediaServer) -> None:
    with pytest.raises(MediaError, match=r"HTTP 404"):
        await fetch_media(f"{server.url}/missing.png", policy("127.0.0.1"))


async def test_unreachable_host_is_a_media_error() -> None:
    with pytest.raises(MediaError, match=r"could not fetch media from '127.0.0.1'"):
        await fetch_media("http://127.0.0.1:9/x.png", policy("127.0.0.1"))


async def test_credentials_in_url_are_refused() -> None:
    with pytest.raises(MediaError, match=r"credentials"):
        await fetch_media("http://user:pw@example.com/x.png", policy())


async def test_served_pixel_bomb_is_refused_by_its_header(server: MediaServer) -> None:
    bomb = png_claiming(32768, 32768)
    server.routes["/bomb.png"] = serve_bytes(bomb)
    data = await fetch_media(f"{server.url}/bomb.png", policy("127.0.0.1"))
    assert len(data) < 1024
    with pytest.raises(MediaDecodeError, match=r"pixels"):
        open_image(data, max_pixels=16 * MB)
