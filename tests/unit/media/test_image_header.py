"""check_image_header reads only the header: real images give their size, images claiming more
pixels than allowed (decompression bombs) are refused without decoding, non-images refused."""

from __future__ import annotations

import io

import pytest
from helpers.media_server import png_bytes, png_claiming

from m3serve.media import MediaError, check_image_header


def test_real_image_gives_its_size() -> None:
    assert check_image_header(png_bytes(7, 5), max_pixels=35) == (7, 5)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_every_supported_format_gives_its_size(fmt: str) -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (9, 4), (10, 200, 10)).save(out, format=fmt)
    assert check_image_header(out.getvalue(), max_pixels=36) == (9, 4)


def test_image_one_pixel_over_the_limit_is_refused() -> None:
    with pytest.raises(MediaError, match=r"7x5 = 35 pixels.*limit of 34"):
        check_image_header(png_bytes(7, 5), max_pixels=34)


def test_gigapixel_png_bomb_is_refused_from_its_header() -> None:
    bomb = png_claiming(32768, 32768)
    assert len(bomb) < 1024
    with pytest.raises(MediaError, match=r"pixels"):
        check_image_header(bomb, max_pixels=16 << 20)


def test_bomb_below_pillows_own_limit_is_refused_by_ours() -> None:
    with pytest.raises(MediaError, match=r"5000x5000 = 25000000 pixels"):
        check_image_header(png_claiming(5000, 5000), max_pixels=1 << 20)


def test_claimed_size_within_the_limit_passes_without_decoding() -> None:
    # Its IDAT holds one row only: a full decode would fail, the header check does not.
    assert check_image_header(png_claiming(3000, 2000), max_pixels=6_000_000) == (3000, 2000)


def ico() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2)).save(out, format="ICO")
    return out.getvalue()


@pytest.mark.parametrize(
    "data",
    [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 8, ico()],
    ids=["empty", "text", "truncated-png", "ico"],
)
def test_non_images_are_refused(data: bytes) -> None:
    with pytest.raises(MediaError, match=r"not an image"):
        check_image_header(data, max_pixels=1 << 20)
