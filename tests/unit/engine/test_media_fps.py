"""A video_url part's `fps`: a positive number travels with the video's MediaBlob; anything
else, or an fps on an image part, is refused with the part's position before any loading."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from m3serve.engine.media import MediaRefused, load_media, parse_part
from m3serve.runtime.config import MediaArgs

VIDEO_URL = "data:video/mp4;base64," + base64.b64encode(b"\x00video").decode()


def video_part(**fields: Any) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": VIDEO_URL, **fields}}


@pytest.mark.parametrize("fps", [2, 0.5, 30.0])
async def test_a_video_fps_reaches_its_blob(fps: float) -> None:
    messages = [{"role": "user", "content": [video_part(fps=fps)]}]
    _, blobs = await load_media(messages, MediaArgs())
    assert [(b.kind, b.fps) for b in blobs] == [("video", float(fps))]


async def test_without_fps_the_processor_decides() -> None:
    _, blobs = await load_media([{"role": "user", "content": [video_part()]}], MediaArgs())
    assert blobs[0].fps is None


@pytest.mark.parametrize(
    ("fps", "words"),
    [
        (0, "positive"),
        (-1.5, "positive"),
        ("2", "a number"),
        (True, "a number"),
        (float("nan"), "a number"),
        (float("inf"), "a number"),
    ],
)
def test_a_bad_fps_is_refused(fps: object, words: str) -> None:
    with pytest.raises(MediaRefused, match=words) as caught:
        parse_part(video_part(fps=fps), "messages.0.content.0")
    assert caught.value.param == "messages.0.content.0"


def test_an_image_takes_no_fps() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "fps": 2}}
    with pytest.raises(MediaRefused, match="only video_url"):
        parse_part(part, "messages.0.content.1")
