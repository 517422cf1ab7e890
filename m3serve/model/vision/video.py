"""Video preprocessing: frames sampled at the processor's fps within its frame limits, decoded
with PyAV (the optional `video` extra), each resized and normalized as an image, then patched in
temporal groups of `temporal_patch_size` frames (model-m3.md §E.1). The last frame is repeated
to fill the last group; groups are split into attention segments of `segment_max_frames`.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from m3serve.model.vision.processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MediaDecodeError,
    normalize,
    patchify,
)
from m3serve.model.vision.processor_config import VideoProcessorConfig
from m3serve.model.vision.resize import ImageSizeError, resize_bicubic, smart_resize

# Frames kept from a video whose length its headers do not tell.
MAX_UNCOUNTED_FRAMES = 2048


class VideoUnavailable(MediaDecodeError):
    """Video input needs PyAV, which is not installed."""


@dataclass(frozen=True)
class ProcessedVideo:
    pixels: np.ndarray  # float32 [sum of t*h*w over grids, patch_dim]
    grids: list[tuple[int, int, int]]  # (t, h, w) per attention segment
    frame_tokens: int  # placeholder tokens per temporal patch
    timestamps: list[float]  # seconds, per temporal patch

    @property
    def temporal_patches(self) -> int:
        return sum(t for t, _, _ in self.grids)


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise VideoUnavailable(
            "video input needs PyAV, which this server does not have (install m3serve[video])"
        ) from exc
    return av


def sample_indices(total: int, video_fps: float, config: VideoProcessorConfig) -> list[int]:
    """Which of `total` frames to keep: `config.fps` per second of video, clamped to
    [min_frames, max_frames] and to the frames there are, evenly spaced."""
    if total <= 0:
        raise MediaDecodeError("the video has no frames")
    duration = total / video_fps if video_fps > 0 else total
    wanted = round(duration * config.fps)
    count = min(max(wanted, config.min_frames), config.max_frames, total)
    return [math.floor(i * total / count) for i in range(count)]


def frame_size(
    height: int,
    width: int,
    frames: int,
    config: VideoProcessorConfig,
    max_long_side: int | None = None,
) -> tuple[int, int]:
    """The resized (height, width) of each frame: the per-frame bounds, with the video's total
    pixel budget shared between its temporal patches (and a request's long-side cap)."""
    image = config.image
    groups = math.ceil(frames / image.temporal_patch_size)
    budget = max(image.min_pixels, config.total_pixels // max(groups, 1))
    cap = min(image.max_pixels, budget)
    return smart_resize(height, width, image.factor, image.min_pixels, cap, max_long_side)


def _decode(
    data: bytes, config: VideoProcessorConfig, max_pixels: int
) -> tuple[list[np.ndarray], list[int], float]:
    av = _import_av()
    try:
        container = av.open(io.BytesIO(data))
    except Exception as exc:
        raise MediaDecodeError(f"cannot decode the video: {exc}") from exc
    with container:
        if not container.streams.video:
            raise MediaDecodeError("the file has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > max_pixels:
            raise MediaDecodeError(
                f"video frames of {width}x{height} pixels exceed the {max_pixels}-pixel limit "
                "(--max-image-pixels)"
            )
        fps = float(stream.average_rate or 0) or 1.0
        total = stream.frames or _estimated_frames(stream, container, fps)
        try:
            frames, indices = _sampled(container.decode(stream), total, fps, config)
        except MediaDecodeError:
            raise
        except Exception as exc:
            raise MediaDecodeError(f"cannot decode the video: {exc}") from exc
    return frames, indices, fps


def _estimated_frames(stream: Any, container: Any, fps: float) -> int:
    if stream.duration is not None and stream.time_base is not None:
        return round(float(stream.duration * stream.time_base) * fps)
    if container.duration is not None:
        return round(container.duration / 1_000_000 * fps)
    return 0


def _sampled(
    decoded: Any, total: int, fps: float, config: VideoProcessorConfig
) -> tuple[list[np.ndarray], list[int]]:
    """Decode only as far as the last sampled frame, converting only the sampled ones. With no
    usable frame count, every frame up to a cap is kept and the sample taken from those."""
    if total <= 0:
        kept = []
        for frame in decoded:
            kept.append(frame.to_ndarray(format="rgb24"))
            if len(kept) >= MAX_UNCOUNTED_FRAMES:
                break
        indices = sample_indices(len(kept), fps, config)
        return [kept[i] for i in indices], indices
    wanted = sample_indices(total, fps, config)
    wanted_set, last = set(wanted), wanted[-1]
    frames, indices = [], []
    for index, frame in enumerate(decoded):
        if index in wanted_set:
            frames.append(frame.to_ndarray(format="rgb24"))
            indices.append(index)
        if index >= last:
            break
    if not frames:
        raise MediaDecodeError("the video has no frames")
    return frames, indices


def preprocess_frames(
    frames: list[np.ndarray],
    indices: list[int],
    fps: float,
    config: VideoProcessorConfig,
    max_long_side: int | None = None,
) -> ProcessedVideo:
    """Sampled RGB frames (H, W, 3 uint8; `indices` their frame numbers at `fps`) to patches."""
    image = config.image
    height, width = frames[0].shape[:2]
    try:
        h, w = frame_size(height, width, len(frames), config, max_long_side)
    except ImageSizeError as exc:
        raise MediaDecodeError(str(exc)) from exc
    stacked = torch.stack([normalize(resize_bicubic(f, h, w), image) for f in frames])
    tp = image.temporal_patch_size
    if pad := -len(frames) % tp:
        stacked = torch.cat([stacked, stacked[-1:].expand(pad, -1, -1, -1)])
    pixels = patchify(stacked, image).numpy()
    gt, gh, gw = stacked.shape[0] // tp, h // image.patch_size, w // image.patch_size
    step = gt if config.segment_max_frames is None else config.segment_max_frames
    grids = [(min(step, gt - s), gh, gw) for s in range(0, gt, step)]
    stamps = [indices[min(t * tp, len(indices) - 1)] / fps for t in range(gt)]
    return ProcessedVideo(pixels, grids, gh * gw // image.merge_size**2, stamps)


def with_fps(config: VideoProcessorConfig, fps: float | None) -> VideoProcessorConfig:
    """`config` sampling at a request's `fps` (None: its own). Only the rate changes: the frame
    count stays clamped to [min_frames, max_frames] and to the frames the video has, so no rate
    can sample past the processor's limits."""
    if fps is None:
        return config
    if not fps > 0 or not math.isfinite(fps):
        raise MediaDecodeError(f"a video's fps must be a positive number, got {fps}")
    return dataclasses.replace(config, fps=float(fps))


def process_video_bytes(
    data: bytes,
    config: VideoProcessorConfig,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_long_side: int | None = None,
    fps: float | None = None,
) -> ProcessedVideo:
    """Encoded video bytes to patches, sampled at `fps` (None: the processor's); every failure
    is a `MediaDecodeError`."""
    config = with_fps(config, fps)
    frames, indices, fps = _decode(data, config, max_pixels)
    return preprocess_frames(frames, indices, fps, config, max_long_side)


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's placeholders (as HF's processor writes it)."""
    return f"]<]{seconds:.1f} seconds[>["
