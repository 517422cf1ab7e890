"""A tokenizer worker's media work: decode and preprocess a request's images and videos, expand
their placeholders in the rendered prompt, and hand the patches to the engine through shared
memory as `MediaInput`s.

Preprocessing is CPU-bound (decode, resize) and runs on a thread, so a worker sharing its event
loop with the API keeps serving; one thread per worker, so concurrent requests queue there
instead of each running torch's whole pool (`preprocess_threads.py` sizes that pool). Segments
are written only once the request is known to be admitted by the tokenizer, so a refused
request leaves none behind.
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from m3serve.model.vision.processor import MediaDecodeError, process_image_bytes
from m3serve.model.vision.processor_config import load_image_config, load_video_config
from m3serve.model.vision.prompt import MediaTokens
from m3serve.model.vision.video import process_video_bytes, timestamp_text
from m3serve.runtime.messages import MediaBlob, MediaInput
from m3serve.runtime.shm import attach_segment, unlink_segment, write_array

HASH_BITS = 63


@dataclass(frozen=True)
class Prepared:
    """One media item, preprocessed, not yet in shared memory."""

    kind: str
    pixels: np.ndarray  # float32 [rows, patch_dim]
    grids: list[tuple[int, int, int]]
    tokens: MediaTokens

    def content_hash(self) -> int:
        """Of the patches and their grids: equal pixels, equal hash (the prefix cache's key)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(np.asarray(self.grids, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(self.pixels).view(np.uint8))
        return int.from_bytes(digest.digest(), "little") & ((1 << HASH_BITS) - 1)

    def to_input(self, spans: list[tuple[int, int]], session: str) -> MediaInput:
        return MediaInput(
            kind=self.kind,  # type: ignore[arg-type]
            pixels=write_array(self.pixels, session),
            grids=self.grids,
            spans=spans,
            content_hash=self.content_hash(),
        )


class MediaPreprocessor:
    """The image and video processors of one model directory."""

    def __init__(self, model_dir: Path | None, max_image_pixels: int) -> None:
        self.image = load_image_config(model_dir)
        self.video = load_video_config(model_dir)
        self.max_image_pixels = max_image_pixels
        # Its thread starts on the first media request.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="preprocess")

    async def prepare_all(self, blobs: list[MediaBlob]) -> list[Prepared]:
        """`prepare` each blob, in order, on this worker's preprocessing thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: [self.prepare(b) for b in blobs])

    def prepare(self, blob: MediaBlob) -> Prepared:
        """Raises `MediaDecodeError` (a 400) for anything it cannot use."""
        if blob.kind == "image":
            image = process_image_bytes(
                blob.data, self.image, blob.max_long_side_pixel, self.max_image_pixels
            )
            count = image.tokens(self.image.merge_size)
            return Prepared(
                "image", image.pixels, [image.grid], MediaTokens("image", [count], [None])
            )
        if blob.kind == "video":
            video = process_video_bytes(
                blob.data, self.video, self.max_image_pixels, blob.max_long_side_pixel, blob.fps
            )
            n = video.temporal_patches
            stamps = [timestamp_text(s) for s in video.timestamps]
            tokens = MediaTokens("video", [video.frame_tokens] * n, stamps)
            return Prepared("video", video.pixels, video.grids, tokens)
        raise MediaDecodeError(f"unknown media kind {blob.kind!r}")


def write_media(
    prepared: list[Prepared], spans: list[list[tuple[int, int]]], session: str
) -> list[MediaInput]:
    """Each item's patches into a segment of its own; all or none (a failure unlinks those
    already written: nobody would read them)."""
    written: list[MediaInput] = []
    try:
        for item, item_spans in zip(prepared, spans, strict=True):
            written.append(item.to_input(item_spans, session))
    except BaseException:
        for done in written:
            unlink_segment(attach_segment(done.pixels.name))
        raise
    return written
