"""`fetch_media`: one entry point for every media URL, dispatched by scheme, under one total
time budget (a server that drips a byte a second is cut off at `timeout_s` all the same)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from m3serve.media.errors import MediaError
from m3serve.media.http import fetch_http
from m3serve.media.local import decode_data_url, read_file_url
from m3serve.media.policy import MediaPolicy

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


async def _data(url: str, policy: MediaPolicy) -> bytes:
    return decode_data_url(url, policy)


_FETCHERS: dict[str, Callable[[str, MediaPolicy], Awaitable[bytes]]] = {
    "http": fetch_http,
    "https": fetch_http,
    "data": _data,
    "file": read_file_url,
}


async def fetch_media(url: str, policy: MediaPolicy) -> bytes:
    """The bytes `url` names, or a MediaError saying why it was refused."""
    match = _SCHEME.match(url)
    if match is None:
        raise MediaError("media URL has no scheme (use http://, https://, data: or file://)")
    scheme = match.group(1).lower()
    fetcher = _FETCHERS.get(scheme)
    if fetcher is None:
        raise MediaError(f"media URL scheme {scheme!r} is not supported (http, https, data, file)")
    try:
        return await asyncio.wait_for(fetcher(url, policy), policy.timeout_s)
    except asyncio.TimeoutError as exc:
        raise MediaError(
            f"media fetch took longer than {policy.timeout_s:g} s (--media-fetch-timeout)"
        ) from exc
