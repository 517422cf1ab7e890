"""open_image, the product's image check: real images of every format a client sends decode at
their size; images claiming more pixels than allowed (decompression bombs) are refused from the
header before decoding, with the message the API returns as a 400; non-images are refused."""

from __future__ import annotations

import io

import pytest
from helpers.media_server import png_bytes, png_claiming
from PIL import Image

from m3serve.model.vision.processor import MediaDecodeError, open_image


def test_real_image_gives_its_size() -> None:
    assert open_image(png_bytes(7, 5), max_pixels=35).size == (7, 5)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_every_supported_format_gives_its_size(fmt: str) -> None:
    out = io.BytesIO()
    Image.new("RGB", (9, 4), (10, 200, 10)).save(out, format=fmt)
    assert open_image(out.getvalue(), max_pixels=36).size == (9, 4)


def test_image_one_pixel_over_the_limit_is_refused() -> None:
    with pytest.raises(MediaDecodeError, match=r"7x5 pixels is larger than the 34-pixel limit"):
        open_image(png_bytes(7, 5), max_pixels=34)


def test_gigapixel_png_bomb_is_refused_from_its_header() -> None:
    bomb = png_claiming(32768, 32768)
    assert len(bomb) < 1024
    with pytest.raises(MediaDecodeError, match=r"pixels"):
        open_image(bomb, max_pixels=16 << 20)


def test_bomb_below_pillows_own_limit_is_refused_by_ours() -> None:
    with pytest.raises(MediaDecodeError, match=r"5000x5000 pixels is larger than"):
        open_image(png_claiming(5000, 5000), max_pixels=1 << 20)


def test_claimed_size_within_the_limit_passes_the_pixel_check() -> None:
    # Its IDAT holds one row only: the header check lets it through, and only decoding fails.
    with pytest.raises(MediaDecodeError, match=r"cannot decode the image"):
        open_image(png_claiming(3000, 2000), max_pixels=6_000_000)


@pytest.mark.parametrize(
    "data",
    [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 8],
    ids=["empty", "text", "truncated-png"],
)
def test_non_images_are_refused(data: bytes) -> None:
    with pytest.raises(MediaDecodeError, match=r"cannot decode the image"):
        open_image(data, max_pixels=1 << 20)
