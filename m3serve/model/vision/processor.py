"""Image preprocessing for MiniMax-M3.1's vision tower, in the tokenizer workers: encoded bytes
to patches exactly as transformers' `MiniMaxM3VLImageProcessor` makes them (model-m3.md §E.1).

decode (header checked against a pixel cap before any pixel is decoded; EXIF orientation
applied; transparency composited onto white) → `smart_resize` → bicubic resize → rescale and
normalize (float32) → patches in merge-window-major order, each (C, T, P, P) with the frame
repeated along T: float32 [grid_h · grid_w, 1176], grid (1, grid_h, grid_w).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from m3serve.model.vision.processor_config import ImageProcessorConfig
from m3serve.model.vision.resize import ImageSizeError, resize_bicubic, smart_resize

# Default cap on decoded pixels: a 16k x 16k image. Anything larger is refused from its header.
DEFAULT_MAX_IMAGE_PIXELS = 16384 * 16384


class MediaDecodeError(ValueError):
    """Media bytes that cannot be used: not an image/video, corrupt, or too large. The message
    is written for the client (the API answers 400)."""


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32 [grid_h * grid_w, patch_dim]
    grid: tuple[int, int, int]  # (t, h, w) in patches

    def tokens(self, merge_size: int) -> int:
        """Placeholder tokens for this image: one per merge window."""
        t, h, w = self.grid
        return t * h * w // (merge_size * merge_size)


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode `data` into an upright RGB image; refuses more than `max_pixels` pixels from the
    header, before decoding (a small file can declare a huge canvas)."""
    try:
        with warnings.catch_warnings():
            # Our cap runs first; Pillow's own bomb warning would only be noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise MediaDecodeError(
                    f"image of {width}x{height} pixels is larger than the {max_pixels}-pixel "
                    "limit (--max-image-pixels)"
                )
            image.load()
            image = ImageOps.exif_transpose(image)
    except MediaDecodeError:
        raise
    except Image.DecompressionBombError as exc:
        # Pillow's own guard (at twice its MAX_IMAGE_PIXELS) fires inside open, before ours.
        raise MediaDecodeError(
            f"image too large to decode ({exc}); the limit is {max_pixels} pixels "
            "(--max-image-pixels)"
        ) from exc
    except Exception as exc:
        raise MediaDecodeError(f"cannot decode the image: {exc}") from exc
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def normalize(image: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """uint8 (C, H, W) to float32, rescaled and normalized in one step as HF fuses them: the
    mean and std are scaled by 1/rescale_factor, so the result is (x - mean') / std'."""
    scale = 1.0 / config.rescale_factor
    mean = (torch.tensor(config.image_mean) * scale).view(-1, 1, 1)
    std = (torch.tensor(config.image_std) * scale).view(-1, 1, 1)
    return image.to(torch.float32).sub_(mean).div_(std)


def patchify(frames: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """Normalized frames (T, C, H, W), T a multiple of the temporal patch, to patches
    [T/tp · H/p · W/p, C · tp · p · p]: temporal group, then merge window (row-major), then the
    window's patches (row-major)."""
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    t, c, h, w = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # -> (gt, gh/m, gw/m, m, m, c, tp, p, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p)


def preprocess_image(
    image: Image.Image, config: ImageProcessorConfig, max_long_side: int | None = None
) -> ProcessedImage:
    """An RGB image to its patches and grid."""
    array = np.array(image)  # a writable copy: torch shares its memory
    height, width = array.shape[:2]
    h, w = smart_resize(
        height, width, config.factor, config.min_pixels, config.max_pixels, max_long_side
    )
    frame = normalize(resize_bicubic(array, h, w), config)
    # A still image is one frame repeated over the temporal patch.
    frames = frame[None].expand(config.temporal_patch_size, -1, -1, -1)
    patches = patchify(frames, config)
    grid = (1, h // config.patch_size, w // config.patch_size)
    return ProcessedImage(patches.numpy(), grid)


def process_image_bytes(
    data: bytes,
    config: ImageProcessorConfig,
    max_long_side: int | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> ProcessedImage:
    """Encoded bytes to patches; every failure is a `MediaDecodeError`."""
    image = open_image(data, max_pixels)
    try:
        return preprocess_image(image, config, max_long_side)
    except ImageSizeError as exc:
        raise MediaDecodeError(str(exc)) from exc
