"""Placeholder expansion: the runs each image or video becomes, that only markers from media
parts count, and that the ids equal transformers' MiniMaxM3VLProcessor for the same prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_vision import run_oracle
from helpers.vision_images import png
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from m3serve.model.chat_template import render_chat
from m3serve.model.tiny.tokenizer import build_tokenizer, write_tokenizer_files
from m3serve.model.vision.processor import process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig
from m3serve.model.vision.prompt import (
    IMAGE_MARKER,
    Escaper,
    MediaTokens,
    PromptMediaError,
    VisionTokens,
    expand,
)

VISION = VisionTokens(image=5, video=6, start=7, end=8)


def fake_encode(text: str) -> list[int]:
    return [100 + (ord(c) % 50) for c in text]


def literal_encode(text: str) -> list[int]:
    return [200] * len(text)


def test_an_image_becomes_start_n_placeholders_end() -> None:
    escaper = Escaper("n")
    pieces = escaper.split(f"ab{IMAGE_MARKER}c")
    done = expand(
        pieces, [MediaTokens("image", [3], [None])], VISION, escaper, fake_encode, literal_encode
    )
    a, b, c = fake_encode("a") + fake_encode("b") + fake_encode("c")
    assert done.ids == [a, b, 7, 5, 5, 5, 8, c]
    assert done.spans == [[(3, 3)]]


def test_a_video_has_a_timestamped_run_per_temporal_patch() -> None:
    escaper = Escaper("n")
    stamps = ["]<]0.0 seconds[>[", "]<]2.0 seconds[>["]
    item = MediaTokens("video", [2, 2], stamps)
    done = expand(
        escaper.split("]<]video[>["), [item], VISION, escaper, fake_encode, literal_encode
    )
    first = fake_encode(stamps[0])
    second = fake_encode(stamps[1])
    assert done.ids == [*first, 7, 6, 6, 8, *second, 7, 6, 6, 8]
    off2 = len(first) + 4 + len(second) + 1
    assert done.spans == [[(len(first) + 1, 2), (off2, 2)]]


def test_marker_text_from_the_client_is_not_an_image() -> None:
    escaper = Escaper()
    messages = escaper.escape([{"role": "user", "content": f"what is {IMAGE_MARKER}?"}])
    assert IMAGE_MARKER not in messages[0]["content"]
    # One marker that a media part rendered, one the client wrote.
    text = f"{messages[0]['content']} {IMAGE_MARKER}"
    pieces = escaper.split(text)
    item = MediaTokens("image", [2], [None])
    done = expand(pieces, [item], VISION, escaper, fake_encode, literal_encode)
    assert done.ids.count(5) == 2  # only the media part's run
    assert literal_encode(IMAGE_MARKER)[0] in done.ids


def test_more_markers_than_media_is_refused() -> None:
    escaper = Escaper()
    with pytest.raises(PromptMediaError, match="2 media placeholders"):
        expand(
            escaper.split(IMAGE_MARKER * 2),
            [MediaTokens("image", [1], [None])],
            VISION,
            escaper,
            fake_encode,
            literal_encode,
        )


def test_escape_leaves_non_strings_and_keys_alone() -> None:
    escaper = Escaper()
    value = {"a": [1, None, {"b": f"x{IMAGE_MARKER}"}], "media": 3}
    escaped = escaper.escape(value)
    assert escaped["a"][:2] == [1, None] and escaped["media"] == 3
    assert escaper.split(escaped["a"][2]["b"])[1] in escaper.literal


def test_ids_equal_hf_processor(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, 512)
    template = (tmp_path / "chat_template.jinja").read_text()
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vision = VisionTokens.lookup(tokenizer.token_to_id)
    assert vision is not None
    blobs = [png(56, 84, 1), png(300, 200, 2), png(30, 900, 3)]
    files = []
    for i, blob in enumerate(blobs):
        (tmp_path / f"{i}.png").write_bytes(blob)
        files.append(str(tmp_path / f"{i}.png"))
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image", "media": 0},
                {"type": "image", "media": 1},
                {"type": "text", "text": "and"},
                {"type": "image", "media": 2},
            ],
        },
    ]
    text = render_chat(template, messages)
    config = ImageProcessorConfig()
    counts = [process_image_bytes(b, config).tokens(config.merge_size) for b in blobs]
    items = [MediaTokens("image", [n], [None]) for n in counts]
    escaper = Escaper()

    def encode(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False).ids

    ours = expand(escaper.split(text), items, vision, escaper, encode, encode)
    hf = run_oracle(
        {
            "kind": "prompt",
            "tokenizer_file": str(tmp_path / "tokenizer.json"),
            "text": text,
            "files": files,
        },
        tmp_path,
    )
    assert ours.ids == hf["input_ids"].tolist()
    for span, n in zip(ours.spans, counts, strict=True):
        ((offset, count),) = span
        assert count == n
        assert set(ours.ids[offset : offset + count]) == {vision.image}


def test_lookup_needs_every_placeholder_token() -> None:
    tokenizer = build_tokenizer(512)
    assert VisionTokens.lookup(tokenizer.token_to_id) is not None
    assert VisionTokens.lookup(lambda token: None) is None


_TINY = build_tokenizer(512)
_LITERAL = Tokenizer.from_str(_TINY.to_str())
_LITERAL.encode_special_tokens = True
_PIECES = [IMAGE_MARKER, "]<]video[>[", "]<]", "[>[", "image", " ", "x", "\ue000", "\ue001"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12))
def test_client_text_never_becomes_a_placeholder(chunks: list[str]) -> None:
    text = "".join(chunks)
    escaper = Escaper()
    escaped = escaper.escape(text)
    vision = VisionTokens.lookup(_TINY.token_to_id)
    assert vision is not None

    def encode(t: str) -> list[int]:
        return _TINY.encode(t, add_special_tokens=False).ids

    def literal(t: str) -> list[int]:
        return _LITERAL.encode(t, add_special_tokens=False).ids

    done = expand(escaper.split(escaped), [], vision, escaper, encode, literal)
    assert vision.image not in done.ids and vision.video not in done.ids
    assert _TINY.decode(done.ids, skip_special_tokens=False) == text
