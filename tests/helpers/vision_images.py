"""Generated test images of many sizes, aspect ratios and modes, encoded as files would be."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def _noise(rng: np.random.Generator, h: int, w: int, channels: int) -> np.ndarray:
    # Noise over a gradient: every pixel differs, so any resampling difference shows.
    ramp = np.linspace(0, 160, w, dtype=np.float64)[None, :, None]
    base = ramp + rng.integers(0, 96, size=(h, w, channels))
    return np.clip(base, 0, 255).astype(np.uint8)


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def varied_images() -> list[tuple[str, bytes]]:
    """20 (name, encoded bytes): tiny, exact-fit, ordinary, huge, extreme aspect, and the
    modes that need converting (L, LA, RGBA, P with transparency, 1-bit, CMYK JPEG)."""
    rng = np.random.default_rng(0)
    rgb_sizes = [
        (5, 7),  # tiny: scaled up to min_pixels
        (28, 28),
        (56, 84),  # already a multiple of 28: no resize
        (100, 130),
        (333, 500),
        (640, 480),
        (1024, 1024),
        (1500, 2100),  # huge: scaled down to max_pixels
        (30, 2800),  # extreme aspect ratio
        (2900, 40),
        (17, 1000),
        (1080, 1920),
        (731, 269),
    ]
    out = []
    for h, w in rgb_sizes:
        out.append((f"rgb_{h}x{w}", _encode(Image.fromarray(_noise(rng, h, w, 3)))))
    out.append(("gray_300x200", _encode(Image.fromarray(_noise(rng, 300, 200, 1)[..., 0]))))
    la = Image.fromarray(_noise(rng, 120, 90, 2), mode="LA")
    out.append(("la_120x90", _encode(la)))
    out.append(("rgba_250x410", _encode(Image.fromarray(_noise(rng, 250, 410, 4), mode="RGBA"))))
    palette = Image.fromarray(_noise(rng, 210, 190, 3)).quantize(64)
    palette.info["transparency"] = 3
    out.append(("palette_210x190", _encode(palette)))
    out.append(
        ("bits_64x64", _encode(Image.fromarray(_noise(rng, 64, 64, 1)[..., 0]).convert("1")))
    )
    cmyk = Image.fromarray(_noise(rng, 180, 240, 4), mode="CMYK")
    out.append(("cmyk_180x240", _encode(cmyk, "JPEG")))
    out.append(("jpeg_477x613", _encode(Image.fromarray(_noise(rng, 477, 613, 3)), "JPEG")))
    return out


def png(h: int, w: int, seed: int = 0) -> bytes:
    """One RGB PNG of h x w pixels."""
    return _encode(Image.fromarray(_noise(np.random.default_rng(seed), h, w, 3)))


def mp4(count: int, fps: int, h: int, w: int) -> bytes:
    """An MPEG-4 video of `count` noise frames at `fps` (skips the test without PyAV)."""
    import pytest

    av = pytest.importorskip("av")
    rng = np.random.default_rng(count)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(count):
            image = _noise(rng, h, w, 3)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
