"""Placeholder expansion: the chat template renders each image part as `]<]image[>[` and each
video part as `]<]video[>[`; here each becomes the token run the vision features replace
(model-m3.md §E.4): start-of-image + N x image + end-of-image for an image, and per temporal
patch of a video an optional `]<]{t:.1f} seconds[>[` timestamp, then start + N x video + end.

Only markers that media parts rendered count. Before rendering, every marker string in the
request's own text (content, tool results, tool definitions, ...) is swapped for a sentinel made
with a per-request nonce, which no client can forge; after rendering, every marker left came from
a media part, and each sentinel is encoded back as plain text, never as the placeholder token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

IMAGE_MARKER = "]<]image[>["
VIDEO_MARKER = "]<]video[>["
IMAGE_START = "]<]start of image[>["
IMAGE_END = "]<]end of image[>["
MARKERS = {"image": IMAGE_MARKER, "video": VIDEO_MARKER}

MediaKind = Literal["image", "video"]
Encode = Callable[[str], list[int]]


class PromptMediaError(ValueError):
    """The rendered prompt's placeholders do not match the request's media."""


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder token ids of a tokenizer."""

    image: int
    video: int
    start: int
    end: int

    @classmethod
    def lookup(cls, token_to_id: Callable[[str], int | None]) -> VisionTokens | None:
        """From a tokenizer's `token_to_id`; None when it lacks any of them."""
        ids = [token_to_id(t) for t in (IMAGE_MARKER, VIDEO_MARKER, IMAGE_START, IMAGE_END)]
        if any(i is None for i in ids):
            return None
        image, video, start, end = (int(i) for i in ids if i is not None)
        return cls(image, video, start, end)


@dataclass(frozen=True)
class MediaTokens:
    """What one media item expands to: per span its token count, and the timestamp text
    before it (videos; None for none)."""

    kind: MediaKind
    counts: Sequence[int]
    timestamps: Sequence[str | None]


@dataclass(frozen=True)
class Expanded:
    ids: list[int]
    spans: list[list[tuple[int, int]]]  # per media item: (offset, count) of each run


class Escaper:
    """Swaps marker strings in request text for sentinels of one request's nonce."""

    def __init__(self, nonce: str | None = None) -> None:
        nonce = nonce or secrets.token_hex(8)
        self.sentinels = {kind: f"\ue000{nonce}{kind[0]}\ue001" for kind in MARKERS}
        self.literal = {self.sentinels[kind]: marker for kind, marker in MARKERS.items()}

    def escape(self, value: Any) -> Any:
        """A copy of `value` (JSON-like) with every marker in its strings made a sentinel."""
        if isinstance(value, str):
            for kind, marker in MARKERS.items():
                if marker in value:
                    value = value.replace(marker, self.sentinels[kind])
            return value
        if isinstance(value, dict):
            return {key: self.escape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape(item) for item in value]
        return value

    def split(self, text: str) -> list[str]:
        """The rendered text cut around markers and sentinels (kept as pieces of their own)."""
        tokens = [*MARKERS.values(), *self.literal]
        pattern = "(" + "|".join(re.escape(t) for t in tokens) + ")"
        return [piece for piece in re.split(pattern, text) if piece]


def media_kinds_in(pieces: Sequence[str]) -> list[MediaKind]:
    """The media kinds whose markers appear in `pieces`, in order."""
    by_marker = {marker: kind for kind, marker in MARKERS.items()}
    return [by_marker[p] for p in pieces if p in by_marker]


def expand(
    pieces: Sequence[str],
    media: Sequence[MediaTokens],
    vision: VisionTokens,
    escaper: Escaper,
    encode: Encode,
    encode_literal: Encode,
) -> Expanded:
    """Token ids of the rendered `pieces` with each marker expanded for its media item, in
    order; plain text through `encode`, escaped marker text through `encode_literal`."""
    kinds = media_kinds_in(pieces)
    if kinds != [m.kind for m in media]:
        raise PromptMediaError(
            f"the chat template rendered {len(kinds)} media placeholders "
            f"({', '.join(kinds) or 'none'}) for {len(media)} media parts"
        )
    by_marker = {marker: kind for kind, marker in MARKERS.items()}
    ids: list[int] = []
    spans: list[list[tuple[int, int]]] = []
    items = iter(media)
    for piece in pieces:
        if piece in by_marker:
            spans.append(_append_media(ids, next(items), vision, encode))
        elif piece in escaper.literal:
            ids.extend(encode_literal(escaper.literal[piece]))
        else:
            ids.extend(encode(piece))
    return Expanded(ids, spans)


def _append_media(
    ids: list[int], item: MediaTokens, vision: VisionTokens, encode: Encode
) -> list[tuple[int, int]]:
    placeholder = vision.image if item.kind == "image" else vision.video
    spans = []
    for count, stamp in zip(item.counts, item.timestamps, strict=True):
        if stamp is not None:
            ids.extend(encode(stamp))
        ids.append(vision.start)
        spans.append((len(ids), count))
        ids.extend([placeholder] * count)
        ids.append(vision.end)
    return spans
