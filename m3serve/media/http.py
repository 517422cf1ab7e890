"""http(s) media: each hop's host resolved and checked (`resolve_checked`), the request sent to
that address with the URL's host in `Host` and in TLS SNI (so certificates are still checked
against the name), redirects followed here — re-checked hop by hop — rather than by httpx, and
the body streamed under the byte cap."""

from __future__ import annotations

import httpx

from m3serve.media.errors import MediaError
from m3serve.media.policy import MediaPolicy
from m3serve.media.resolve import resolve_checked

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_USER_AGENT = "m3serve-media-fetch"


def parse_http_url(url: str | httpx.URL) -> httpx.URL:
    """`url` as an http(s) URL with a host and no credentials, or a MediaError."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise MediaError("media URL is not a valid URL") from exc
    if parsed.scheme not in _DEFAULT_PORTS:
        raise MediaError(f"media URL scheme {parsed.scheme!r} is not followed over http")
    if not parsed.raw_host:
        raise MediaError("media URL has no host")
    if parsed.userinfo:
        raise MediaError("media URLs with credentials (user:password@) are not accepted")
    return parsed


def _too_big(size: int, policy: MediaPolicy) -> MediaError:
    return MediaError(
        f"media is {size} bytes or more, above the limit of {policy.max_bytes} bytes "
        "(--max-media-bytes)"
    )


def _check_headers(response: httpx.Response, policy: MediaPolicy) -> None:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # We asked for identity and read raw bytes: a compressed body is not the media, and
        # inflating it here could outgrow the byte cap many times over.
        raise MediaError(f"media server sent {encoding!r}-encoded content, which is refused")
    length = response.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
        raise _too_big(int(length), policy)


async def _read_capped(response: httpx.Response, policy: MediaPolicy) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_big(len(body), policy)
    return bytes(body)


def _redirect_target(url: httpx.URL, location: str) -> httpx.URL:
    try:
        target = url.join(location)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise MediaError("media URL redirected to something that is not an http(s) URL") from exc
    return parse_http_url(target)


def _pinned_request(url: httpx.URL, address: str, policy: MediaPolicy) -> httpx.Request:
    """A GET for `url` sent to `address`: the name stays in Host and, for https, in SNI (and so
    in the certificate check)."""
    headers = {
        "Host": url.netloc.decode("ascii"),
        "Accept-Encoding": "identity",
        "User-Agent": _USER_AGENT,
    }
    extensions: dict[str, object] = {"timeout": httpx.Timeout(policy.timeout_s).as_dict()}
    if url.scheme == "https":
        extensions["sni_hostname"] = url.raw_host.decode("ascii")
    return httpx.Request("GET", url.copy_with(host=address), headers=headers, extensions=extensions)


async def _answer(
    url: httpx.URL, response: httpx.Response, policy: MediaPolicy
) -> bytes | httpx.URL:
    if response.status_code in _REDIRECTS:
        location = response.headers.get("location")
        if not location:
            raise MediaError("media URL redirected without a Location")
        return _redirect_target(url, location)
    if not 200 <= response.status_code < 300:
        raise MediaError(f"media URL answered HTTP {response.status_code}")
    _check_headers(response, policy)
    return await _read_capped(response, policy)


async def _request(url: httpx.URL, address: str, policy: MediaPolicy) -> bytes | httpx.URL:
    # The transport itself, not a client: no redirect handling of httpx's own, no proxy from
    # the environment (which would resolve the name again), and a fresh pool per hop, so no
    # connection made for one name serves another.
    async with httpx.AsyncHTTPTransport(retries=0) as transport:
        response = await transport.handle_async_request(_pinned_request(url, address, policy))
        try:
            return await _answer(url, response, policy)
        finally:
            await response.aclose()


async def _hop(url: httpx.URL, policy: MediaPolicy) -> bytes | httpx.URL:
    """One request: the body, or where a redirect points. The checked addresses are tried in
    order until one accepts the connection (localhost may answer on 127.0.0.1 but not ::1)."""
    port = url.port or _DEFAULT_PORTS[url.scheme]
    addresses = await resolve_checked(url.raw_host.decode("ascii"), port, policy)
    for address in addresses[:-1]:
        try:
            return await _request(url, str(address), policy)
        except httpx.ConnectError:
            continue
    return await _request(url, str(addresses[-1]), policy)


async def fetch_http(url: str, policy: MediaPolicy) -> bytes:
    """The body at an http(s) URL, following at most `policy.max_redirects` redirects."""
    current = parse_http_url(url)
    for _ in range(policy.max_redirects + 1):
        try:
            result = await _hop(current, policy)
        except httpx.HTTPError as exc:
            host = current.raw_host.decode("ascii")
            raise MediaError(f"could not fetch media from {host!r}: {type(exc).__name__}") from exc
        if isinstance(result, bytes):
            return result
        current = result
    raise MediaError(f"media URL redirected more than {policy.max_redirects} times")
