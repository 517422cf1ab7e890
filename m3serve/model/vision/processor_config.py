"""The image and video processors' settings, read from the checkpoint's
`preprocessor_config.json` / `video_preprocessor_config.json` when it has them, otherwise the
defaults of MiniMax-M3.1's processors (model-m3.md §E.1)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

IMAGE_CONFIG_FILE = "preprocessor_config.json"
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# One patch: (channels, temporal patch, patch, patch) values.
CHANNELS = 3


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 576 * 28 * 28
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @property
    def factor(self) -> int:
        """What resized sides are multiples of: one merge window of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class VideoProcessorConfig:
    image: ImageProcessorConfig = ImageProcessorConfig(max_pixels=768 * 28 * 28)
    fps: float = 1.0
    min_frames: int = 4
    max_frames: int = 768
    total_pixels: int = int(64000 * 28 * 28 * 0.9)
    # Temporal patches per attention segment (None: the whole video is one).
    segment_max_frames: int | None = 4


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _pixels(data: dict[str, Any], base: ImageProcessorConfig) -> tuple[int, int]:
    # HF's order: `size` {shortest_edge, longest_edge} (the pixel bounds, despite the names),
    # then explicit min_pixels / max_pixels over it.
    lo, hi = base.min_pixels, base.max_pixels
    size = data.get("size")
    if isinstance(size, dict) and "shortest_edge" in size and "longest_edge" in size:
        lo, hi = int(size["shortest_edge"]), int(size["longest_edge"])
    if data.get("min_pixels") is not None:
        lo = int(data["min_pixels"])
    if data.get("max_pixels") is not None:
        hi = int(data["max_pixels"])
    return lo, hi


def _image_from(data: dict[str, Any], base: ImageProcessorConfig) -> ImageProcessorConfig:
    lo, hi = _pixels(data, base)
    fields: dict[str, Any] = {"min_pixels": lo, "max_pixels": hi}
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if data.get(key) is not None:
            fields[key] = int(data[key])
    if data.get("rescale_factor") is not None:
        fields["rescale_factor"] = float(data["rescale_factor"])
    for key in ("image_mean", "image_std"):
        if isinstance(data.get(key), list) and len(data[key]) == CHANNELS:
            fields[key] = tuple(float(v) for v in data[key])
    config = replace(base, **fields)
    if config.min_pixels <= 0 or config.max_pixels < config.min_pixels:
        raise ValueError(f"bad pixel bounds {config.min_pixels}..{config.max_pixels}")
    return config


def load_image_config(model_dir: Path | None) -> ImageProcessorConfig:
    """The image processor of `model_dir` (None or no file: the defaults)."""
    if model_dir is None:
        return ImageProcessorConfig()
    return _image_from(_read(Path(model_dir) / IMAGE_CONFIG_FILE), ImageProcessorConfig())


def load_video_config(model_dir: Path | None) -> VideoProcessorConfig:
    """The video processor of `model_dir` (None or no file: the defaults)."""
    base = VideoProcessorConfig()
    data = _read(Path(model_dir) / VIDEO_CONFIG_FILE) if model_dir is not None else {}
    if not data:
        return base
    fields: dict[str, Any] = {"image": _image_from(data, base.image)}
    for key in ("min_frames", "max_frames", "total_pixels"):
        if data.get(key) is not None:
            fields[key] = int(data[key])
    if data.get("fps") is not None:
        fields["fps"] = float(data["fps"])
    if "vision_segment_max_frames" in data:
        value = data["vision_segment_max_frames"]
        fields["segment_max_frames"] = None if value is None else int(value)
    return replace(base, **fields)
