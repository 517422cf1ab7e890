"""The target size of an image (`smart_resize`) and the resize itself.

The resize reproduces what transformers' MiniMax-M3.1 image processor does on CPU, bit for bit:
its torchvision backend hands a uint8 CHW tensor to torch's antialiased bicubic interpolation
(the native uint8 kernel, no float round trip), so we call that same kernel; torchvision itself
is not needed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

MAX_ASPECT_RATIO = 200


class ImageSizeError(ValueError):
    """An image whose shape cannot be brought to the processor's bounds."""


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    max_long_side: int | None = None,
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, the area within [min_pixels,
    max_pixels], the aspect ratio kept as closely as rounding allows; with `max_long_side`, the
    longer side also at most that (rounded down to `factor`, never below one `factor`)."""
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"image of {width}x{height} pixels: the aspect ratio must be at most "
            f"{MAX_ASPECT_RATIO}:1"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if max_long_side is not None and max(h_bar, w_bar) > max_long_side:
        # A request's cap on the longer side: scale both sides down by the same ratio.
        scale = max_long_side / max(height, width)
        h_bar = max(factor, math.floor(height * scale / factor) * factor)
        w_bar = max(factor, math.floor(width * scale / factor) * factor)
    return h_bar, w_bar


def resize_bicubic(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """An RGB uint8 image (H, W, 3) resized to (3, height, width) uint8, antialiased bicubic."""
    chw = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).contiguous()
    if tuple(chw.shape[1:]) == (height, width):
        return chw
    out = F.interpolate(
        chw[None], size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return out[0]
