"""Media that needs no network: `data:` URLs (base64) and `file://` URLs, the latter only inside
the policy's allowed directory — judged on the real path (links and `..` resolved) and again on
the file actually opened, so a link swapped in between cannot point the read elsewhere."""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from m3serve.media.errors import MediaError
from m3serve.media.policy import MediaPolicy

_WHITESPACE = str.maketrans("", "", " \t\r\n")


def decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of a base64 `data:` URL, refused past the policy's byte cap before decoding."""
    return decode_data_bytes(url, policy.max_bytes)


def decode_data_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL, refused past `max_bytes` before decoding."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("data: URL has no ',' before its payload")
    if not header.lower().endswith(";base64"):
        raise MediaError("data: URLs must be base64-encoded (data:<type>;base64,<data>)")
    payload = payload.translate(_WHITESPACE)
    # 4 base64 characters carry 3 bytes: refuse before allocating the decoded copy.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaError(f"data: URL holds more than {max_bytes} bytes (--max-media-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError("data: URL payload is not valid base64") from exc
    if not data:
        raise MediaError("data: URL is empty")
    if len(data) > max_bytes:
        raise MediaError(
            f"data: URL holds {len(data)} bytes, above the limit of {max_bytes} (--max-media-bytes)"
        )
    return data


def _local_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must name a local path (file:///path)")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise MediaError("file:// URL has no valid path")
    return Path(path)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


_OUTSIDE = "file:// URL is outside the allowed local media directory"


def _read_up_to(fd: int, limit: int) -> bytes:
    # read() may return less than asked, even on a regular file.
    parts: list[bytes] = []
    size = 0
    while size < limit and (part := os.read(fd, limit - size)):
        parts.append(part)
        size += len(part)
    return b"".join(parts)


def _check_opened(fd: int, root: Path, max_bytes: int) -> None:
    opened = Path(f"/proc/self/fd/{fd}")
    if opened.exists() and not _inside(Path(os.readlink(opened)), root):
        # A directory above the file was swapped for a link since resolve().
        raise MediaError(_OUTSIDE)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise MediaError("file:// URL does not name a regular file")
    if info.st_size > max_bytes:
        raise MediaError(
            f"file is {info.st_size} bytes, above the limit of {max_bytes} (--max-media-bytes)"
        )


def _read_confined(path: Path, root: Path, max_bytes: int) -> bytes:
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise MediaError("file:// URL names no readable file") from exc
    if not _inside(real, root):
        raise MediaError(_OUTSIDE)
    # O_NOFOLLOW: the last component cannot have become a link since resolve(); O_NONBLOCK:
    # a FIFO swapped in does not hang the open.
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise MediaError("file:// URL names no readable file") from exc
    try:
        _check_opened(fd, root, max_bytes)
        data = _read_up_to(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise MediaError(f"file is larger than the limit of {max_bytes} bytes (--max-media-bytes)")
    return data


async def read_file_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of a `file://` URL inside `policy.allowed_local_path`."""
    if policy.allowed_local_path is None:
        raise MediaError("file:// media URLs are disabled (see --allowed-local-media-path)")
    path = _local_path(url)
    try:
        root = policy.allowed_local_path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise MediaError("the allowed local media directory does not exist") from exc
    return await asyncio.to_thread(_read_confined, path, root, policy.max_bytes)
