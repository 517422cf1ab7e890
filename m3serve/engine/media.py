"""Media content parts of chat messages, for the API and for library callers alike: OpenAI's
`image_url` / `video_url` parts are checked, their bytes loaded (`data:` URLs decoded here;
http(s) and file URLs through the media fetcher), and each part replaced by the
`{"type": "image"|"video", "media": i}` part the tokenizer expands, with the bytes as the
request's `MediaBlob`s in the same order.

Checking (`media_parts`) needs no I/O and runs with the rest of the request's validation;
loading (`load_media`) runs only after, so nothing is fetched for a request that is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from m3serve.media import MediaError, MediaPolicy, decode_data_bytes, fetch_media
from m3serve.runtime.config import MediaArgs
from m3serve.runtime.messages import MediaBlob

PART_KINDS: dict[str, Literal["image", "video"]] = {"image_url": "image", "video_url": "video"}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?", re.ASCII)
MIN_LONG_SIDE = 28


class MediaRefused(ValueError):
    """A media part that cannot be used; `param` names where it sits in the request."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class MediaPart:
    kind: Literal["image", "video"]
    url: str
    max_long_side_pixel: int | None
    param: str
    fps: float | None = None


def is_media_part(part: dict[str, Any]) -> bool:
    return part.get("type") in PART_KINDS


def parse_part(part: dict[str, Any], param: str) -> MediaPart:
    """An `image_url` / `video_url` part's URL and options: `max_long_side_pixel` (as
    MiniMax's API: a cap on the longer side, of an image or of each video frame); `detail` is
    accepted and ignored (the processor's own pixel bounds decide the resolution); a video's
    `fps` (as vLLM's and SGLang's per-request video fps) replaces the processor's sampling rate,
    the frame count still within the processor's frame limits."""
    kind_name = part["type"]
    body = part.get(kind_name)
    if isinstance(body, str):  # some clients send the URL bare
        body = {"url": body}
    if not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"]:
        raise MediaRefused(f"a {kind_name} part needs {kind_name}.url (a string)", param)
    cap = body.get("max_long_side_pixel")
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, int) or cap < MIN_LONG_SIDE
    ):
        raise MediaRefused(
            f"{kind_name}.max_long_side_pixel must be an integer >= {MIN_LONG_SIDE}", param
        )
    url = body["url"]
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("data", "http", "https", "file"):
        raise MediaRefused(f"{kind_name}.url must be a data:, http(s): or file: URL", param)
    return MediaPart(PART_KINDS[kind_name], url, cap, param, _fps(kind_name, body, param))


def _fps(kind_name: str, body: dict[str, Any], param: str) -> float | None:
    fps = body.get("fps")
    if fps is None:
        return None
    if kind_name != "video_url":
        raise MediaRefused(f"{kind_name}.fps: only video_url parts take a sampling rate", param)
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps):
        raise MediaRefused("video_url.fps must be a number", param)
    if fps <= 0:
        raise MediaRefused(f"video_url.fps must be positive, got {fps}", param)
    return float(fps)


def media_parts(messages: list[dict[str, Any]]) -> list[MediaPart]:
    """Every media part of `messages` (builtins), in order, checked; no I/O."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and is_media_part(part):
                    found.append(parse_part(part, f"messages.{i}.content.{j}"))
    return found


def decode_data_url(url: str, kind: str, max_bytes: int, param: str) -> bytes:
    """The payload of a base64 `data:` URL whose media type must be of `kind`; the decoding and
    its byte cap are the fetcher's (`m3serve.media.decode_data_bytes`)."""
    match = _DATA_URL.match(url)
    mime = (match.group("mime") or "").lower() if match is not None else ""
    if not mime.startswith(kind + "/"):
        raise MediaRefused(f"a {kind} data: URL needs a {kind}/* media type, got {mime!r}", param)
    try:
        return decode_data_bytes(url, max_bytes)
    except MediaError as exc:
        raise MediaRefused(f"the {kind} {exc}", param) from exc


async def fetch_remote(url: str, part: MediaPart, args: MediaArgs) -> bytes:
    """http(s) and file URLs, through the fetcher that cannot be turned against the host."""
    try:
        return await fetch_media(url, media_policy(args))
    except MediaError as exc:
        raise MediaRefused(str(exc), part.param) from exc


def media_policy(args: MediaArgs) -> MediaPolicy:
    return MediaPolicy.from_values(
        max_bytes=args.max_media_bytes,
        timeout_s=args.media_fetch_timeout,
        allowed_domains=args.allowed_media_domains,
        allowed_local_path=args.allowed_local_media_path,
    )


async def load_part(part: MediaPart, args: MediaArgs) -> bytes:
    if part.url[:5].lower() == "data:":
        return decode_data_url(part.url, part.kind, args.max_media_bytes, part.param)
    return await fetch_remote(part.url, part, args)


async def load_media(
    messages: list[dict[str, Any]], args: MediaArgs
) -> tuple[list[dict[str, Any]], list[MediaBlob]]:
    """`messages` with each media part replaced by its reference, and the media in order.
    Messages without media come back as they are."""
    parts = media_parts(messages)
    if not parts:
        return messages, []
    blobs = []
    for part in parts:
        data = await load_part(part, args)
        blobs.append(MediaBlob(part.kind, data, part.max_long_side_pixel, part.fps))
    counter = iter(range(len(parts)))
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and is_media_part(p) for p in content
        ):
            content = [
                {"type": PART_KINDS[p["type"]], "media": next(counter)}
                if isinstance(p, dict) and is_media_part(p)
                else p
                for p in content
            ]
            message = {**message, "content": content}
        out.append(message)
    return out, blobs
