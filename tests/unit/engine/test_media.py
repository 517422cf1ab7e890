"""Media parts of chat messages: which parts count, data: URL decoding (media type, base64,
the byte cap from the length), and the replacement of parts by ordered references."""

from __future__ import annotations

import argparse
import base64

import pytest

from m3serve.engine.media import (
    MediaRefused,
    decode_data_url,
    load_media,
    media_parts,
)
from m3serve.runtime.config import ConfigInvalid, MediaArgs, ServerArgs


def url(payload: bytes, head: str = "data:image/png;base64,") -> str:
    return head + base64.b64encode(payload).decode()


def test_data_url_media_type_parameters_are_allowed() -> None:
    assert decode_data_url(url(b"abc", "data:image/png;name=x.png;base64,"), "image", 10, "p") == (
        b"abc"
    )
    assert decode_data_url(url(b"abc", "data:IMAGE/JPEG;base64,"), "image", 10, "p") == b"abc"


def test_line_wrapped_base64_is_accepted() -> None:
    encoded = base64.encodebytes(b"y" * 200).decode()  # 76-character lines
    assert "\n" in encoded
    assert decode_data_url("data:image/png;base64," + encoded, "image", 1000, "p") == b"y" * 200


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("data:;base64,QUJD", "image/*"),
        ("data:image/png,abc", "base64"),
        ("data:image/png;base64,QUJ", "not valid base64"),
        ("data:image/png;base64,", "empty"),
        ("data:video/mp4;base64,QUJD", "image/*"),
    ],
)
def test_bad_data_urls_are_refused(value: str, words: str) -> None:
    with pytest.raises(MediaRefused, match=words):
        decode_data_url(value, "image", 100, "p")


def test_the_byte_cap_refuses_from_the_length_alone() -> None:
    # Not valid base64, but long: refused for its size, never decoded.
    with pytest.raises(MediaRefused, match="--max-media-bytes"):
        decode_data_url("data:image/png;base64," + "!" * 4000, "image", 1000, "p")
    assert len(decode_data_url(url(b"x" * 1000), "image", 1000, "p")) == 1000
    with pytest.raises(MediaRefused, match="--max-media-bytes"):
        decode_data_url(url(b"x" * 1001), "image", 1000, "p")


def test_only_image_url_and_video_url_parts_count() -> None:
    messages = [
        {"role": "system", "content": "plain"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "t"},
                {"type": "image_url", "image_url": {"url": url(b"a")}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": "https://h/v.mp4"}}],
        },
    ]
    parts = media_parts(messages)
    assert [(p.kind, p.param) for p in parts] == [
        ("image", "messages.1.content.1"),
        ("video", "messages.2.content.0"),
    ]


async def test_load_media_keeps_text_only_messages_as_they_are() -> None:
    messages = [{"role": "user", "content": "hi"}]
    out, blobs = await load_media(messages, MediaArgs())
    assert out is messages and blobs == []


async def test_load_media_does_not_touch_the_callers_messages() -> None:
    part = {"type": "image_url", "image_url": {"url": url(b"img")}}
    messages = [{"role": "user", "content": [part]}]
    out, blobs = await load_media(messages, MediaArgs())
    assert messages[0]["content"] == [part]
    assert out[0]["content"] == [{"type": "image", "media": 0}]
    assert blobs[0].data == b"img"


def test_media_flags_parse_into_their_section() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_arguments(parser)
    argv = ["--max-media-bytes", "1000", "--max-image-pixels", "5000", "--media-fetch-timeout", "2"]
    argv += ["--allowed-media-domains", "a.test", "b.test", "--allowed-local-media-path", "/srv"]
    args = ServerArgs.from_args(parser.parse_args(argv))
    assert args.media == MediaArgs(1000, 5000, ["a.test", "b.test"], "/srv", 2.0)


@pytest.mark.parametrize(
    "fields", [{"max_media_bytes": 0}, {"max_image_pixels": 0}, {"media_fetch_timeout": 0}]
)
def test_media_limits_must_be_positive(fields: dict) -> None:
    with pytest.raises(ConfigInvalid):
        MediaArgs(**fields)
