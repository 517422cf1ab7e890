"""image_url / video_url parts at /v1/chat/completions and input_image at /v1/responses, with a
scripted engine: a data: URL, an http URL of an allowed host and a file in the allowed directory
reach the engine as MediaBlobs and media references in the message; malformed parts, bad base64,
a wrong media type, oversize payloads and URLs the fetcher refuses are 400s in OpenAI's error
shape, before the engine sees anything."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from helpers.media_server import MediaServer, serve_bytes
from helpers.scripted_engine import ScriptedEngine
from helpers.vision_images import png

from m3serve.runtime.config import ServerArgs

CHAT = "/v1/chat/completions"
IMAGE = png(56, 84)


def data_url(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


VIDEO_URL = data_url(b"\x00video", "video/mp4")


def image_message(part: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}


def says(req):
    return ["A picture."]


async def test_a_data_url_image_reaches_the_engine(serve) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE), "detail": "high"}}
    async with serve(says) as s:
        response = await s.post(CHAT, {"messages": [image_message(part)]})
        req = s.engine.seen[-1]
    assert response.status_code == 200, response.text
    assert [(b.kind, b.data) for b in req.media] == [("image", IMAGE)]
    assert req.messages[0]["content"][1] == {"type": "image", "media": 0}
    assert req.messages[0]["content"][0] == {"type": "text", "text": "What is this?"}


async def test_media_is_numbered_in_order_across_messages(serve) -> None:
    other = png(30, 30, 5)
    first = image_message({"type": "image_url", "image_url": {"url": data_url(IMAGE)}})
    second = image_message({"type": "image_url", "image_url": data_url(other)})  # a bare URL
    video = {"type": "video_url", "video_url": {"url": data_url(b"\x00video", "video/mp4")}}
    async with serve(says) as s:
        body = {"messages": [first, {"role": "assistant", "content": "ok"}, second]}
        body["messages"].append(image_message(video))
        response = await s.post(CHAT, body)
        req = s.engine.seen[-1]
    assert response.status_code == 200, response.text
    assert [b.kind for b in req.media] == ["image", "image", "video"]
    assert req.media[1].data == other
    refs = [m["content"][1] for m in req.messages if isinstance(m["content"], list)]
    assert refs == [
        {"type": "image", "media": 0},
        {"type": "image", "media": 1},
        {"type": "video", "media": 2},
    ]


async def test_max_long_side_pixel_travels_with_the_image(serve) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE), "max_long_side_pixel": 448}}
    async with serve(says) as s:
        await s.post(CHAT, {"messages": [image_message(part)]})
        assert s.engine.seen[-1].media[0].max_long_side_pixel == 448


async def test_a_video_fps_travels_with_the_video(serve) -> None:
    part = {"type": "video_url", "video_url": {"url": VIDEO_URL, "fps": 2}}
    async with serve(says) as s:
        response = await s.post(CHAT, {"messages": [image_message(part)]})
        assert response.status_code == 200, response.text
        assert s.engine.seen[-1].media[0].fps == 2.0


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url"}, "image_url.url"),
        ({"type": "image_url", "image_url": {"url": 5}}, "image_url.url"),
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "data:, http(s): or file:"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": data_url(IMAGE, "text/plain")}}, "image/*"),
        ({"type": "video_url", "video_url": {"url": data_url(IMAGE)}}, "video/*"),
        (
            {"type": "image_url", "image_url": {"url": data_url(IMAGE), "max_long_side_pixel": 3}},
            "max_long_side_pixel",
        ),
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, "loopback"),
        ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/a"}}, "metadata"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "file://"),
        ({"type": "image", "image": "x"}, "image_url"),
        ({"type": "input_audio"}, "input_audio"),
        ({"type": "video_url", "video_url": {"url": VIDEO_URL, "fps": 0}}, "positive"),
        ({"type": "video_url", "video_url": {"url": VIDEO_URL, "fps": -1}}, "positive"),
        ({"type": "video_url", "video_url": {"url": VIDEO_URL, "fps": "x"}}, "fps"),
    ],
)
async def test_a_bad_media_part_is_a_400_before_the_engine(serve, part, words) -> None:
    async with serve(says) as s:
        response = await s.post(CHAT, {"messages": [image_message(part)]})
        assert s.engine.seen == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert error["param"] == "messages.0.content.1"


async def test_an_oversize_image_is_a_400(serve, model_dir) -> None:
    engine = ScriptedEngine(says, str(model_dir), ServerArgs.from_kwargs(max_media_bytes=100))
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}
    async with serve(engine) as s:
        response = await s.post(CHAT, {"messages": [image_message(part)]})
        assert s.engine.seen == []
    assert response.status_code == 400
    assert "--max-media-bytes" in response.json()["error"]["message"]


async def test_an_allowed_host_is_fetched_only_for_a_valid_request(serve, model_dir) -> None:
    media = MediaServer(routes={"/a.png": serve_bytes(IMAGE)})
    await media.start()
    args = ServerArgs.from_kwargs(allowed_media_domains=["127.0.0.1"])
    part = {"type": "image_url", "image_url": {"url": f"{media.url}/a.png"}}
    try:
        async with serve(ScriptedEngine(says, str(model_dir), args)) as s:
            body = {"messages": [image_message(part)], "thinking": {"type": "sideways"}}
            refused = await s.post(CHAT, body)
            assert media.paths() == []  # an invalid request fetches nothing
            served = await s.post(CHAT, {"messages": [image_message(part)]})
            req = s.engine.seen[-1]
    finally:
        await media.close()
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking"
    assert served.status_code == 200, served.text
    assert media.paths() == ["/a.png"]
    assert [b.data for b in req.media] == [IMAGE]


async def test_a_file_in_the_allowed_directory_is_read(serve, model_dir, tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(IMAGE)
    args = ServerArgs.from_kwargs(allowed_local_media_path=str(tmp_path))
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/cat.png"}}
    async with serve(ScriptedEngine(says, str(model_dir), args)) as s:
        response = await s.post(CHAT, {"messages": [image_message(part)]})
        escape = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/../etc/passwd"}}
        outside = await s.post(CHAT, {"messages": [image_message(escape)]})
        req = s.engine.seen[-1]
    assert response.status_code == 200, response.text
    assert req.media[0].data == IMAGE
    assert outside.status_code == 400


async def test_responses_input_image_reaches_the_engine(serve) -> None:
    content = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": data_url(IMAGE), "detail": "auto"},
    ]
    async with serve(says) as s:
        body = {"model": "m", "input": [{"role": "user", "content": content}]}
        response = await s.post("/v1/responses", body)
        req = s.engine.seen[-1]
    assert response.status_code == 200, response.text
    assert [b.data for b in req.media] == [IMAGE]
    assert req.messages[-1]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "media": 0},
    ]
