"""Image preprocessing equals transformers' MiniMax-M3.1 image processor exactly, and the
target-size rules (smart_resize, max_long_side_pixel, the pixel cap) hold."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from helpers.hf_vision import run_oracle
from helpers.vision_images import png, varied_images
from PIL import Image

from m3serve.model.vision.processor import MediaDecodeError, open_image, process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig, load_image_config
from m3serve.model.vision.resize import ImageSizeError, smart_resize

CONFIG = ImageProcessorConfig()


def _oracle(blobs: list[bytes], tmp_path: Path, kwargs: dict | None = None) -> dict:
    files = []
    for i, blob in enumerate(blobs):
        path = tmp_path / f"{i}.img"
        path.write_bytes(blob)
        files.append(str(path))
    return run_oracle({"kind": "images", "files": files, "kwargs": kwargs or {}}, tmp_path)


def test_pixels_and_grids_equal_hf_exactly(tmp_path: Path) -> None:
    named = varied_images()
    assert len(named) == 20
    hf = _oracle([blob for _, blob in named], tmp_path)
    for i, (name, blob) in enumerate(named):
        ours = process_image_bytes(blob, CONFIG)
        assert ours.grid == tuple(hf[f"grid_{i}"][0]), name
        assert ours.pixels.dtype == np.float32
        assert ours.pixels.shape == hf[f"pixels_{i}"].shape, name
        assert np.array_equal(ours.pixels, hf[f"pixels_{i}"]), name


def test_checkpoint_pixel_bounds_equal_hf(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_pixels": 12544, "max_pixels": 50176, "image_mean": [0.5, 0.5, 0.5],'
        ' "image_std": [0.5, 0.5, 0.5]}'
    )
    config = load_image_config(tmp_path)
    assert (config.min_pixels, config.max_pixels) == (12544, 50176)
    blobs = [png(20, 30, 1), png(900, 700, 2)]
    kwargs = {"min_pixels": 12544, "max_pixels": 50176, "image_mean": [0.5] * 3}
    kwargs["image_std"] = [0.5] * 3
    hf = _oracle(blobs, tmp_path, kwargs)
    for i, blob in enumerate(blobs):
        ours = process_image_bytes(blob, config)
        assert np.array_equal(ours.pixels, hf[f"pixels_{i}"])


def test_missing_config_gives_the_defaults(tmp_path: Path) -> None:
    assert load_image_config(tmp_path) == ImageProcessorConfig()
    assert load_image_config(None).max_pixels == 576 * 28 * 28


@pytest.mark.parametrize(
    ("h", "w"), [(1, 1), (27, 29), (100, 100), (4000, 3000), (28, 5000), (10000, 60)]
)
def test_smart_resize_sides_are_multiples_within_bounds(h: int, w: int) -> None:
    lo, hi = CONFIG.min_pixels, CONFIG.max_pixels
    rh, rw = smart_resize(h, w, 28, lo, hi)
    assert rh % 28 == 0 and rw % 28 == 0
    assert rh >= 28 and rw >= 28
    assert rh * rw <= hi
    # Only the rounding of an extreme aspect ratio can leave the area under the minimum.
    assert rh * rw >= lo or max(h, w) / min(h, w) > 50


def test_smart_resize_refuses_aspect_over_200() -> None:
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 3136, 451584)
    assert smart_resize(10, 2000, 28, 3136, 451584)[1] % 28 == 0


def test_max_long_side_caps_the_longer_side() -> None:
    blob = png(600, 900)
    free = process_image_bytes(blob, CONFIG)
    capped = process_image_bytes(blob, CONFIG, max_long_side=448)
    _, fh, fw = free.grid
    _, ch, cw = capped.grid
    assert max(ch, cw) * 14 <= 448
    assert (ch, cw) < (fh, fw)
    # The aspect ratio survives the cap (to within one merge window).
    assert abs(cw / ch - 900 / 600) < 0.2
    assert capped.pixels.shape == (ch * cw, 1176)


def test_max_long_side_above_the_size_changes_nothing() -> None:
    blob = png(300, 200)
    assert np.array_equal(
        process_image_bytes(blob, CONFIG, max_long_side=4096).pixels,
        process_image_bytes(blob, CONFIG).pixels,
    )


def test_pixel_cap_refuses_from_the_header() -> None:
    # A 1-bit 20000x20000 PNG is tiny on disk; its header alone must refuse it.
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 200_000
    with pytest.raises(MediaDecodeError, match="--max-image-pixels"):
        open_image(buf.getvalue(), max_pixels=10_000_000)


def test_bad_bytes_are_a_decode_error() -> None:
    with pytest.raises(MediaDecodeError, match="cannot decode"):
        process_image_bytes(b"not an image at all", CONFIG)
    with pytest.raises(MediaDecodeError):
        process_image_bytes(png(50, 50)[:60], CONFIG)


def test_token_count_is_one_per_merge_window() -> None:
    image = process_image_bytes(png(56, 84), CONFIG)
    assert image.grid == (1, 4, 6)
    assert image.tokens(CONFIG.merge_size) == 6
