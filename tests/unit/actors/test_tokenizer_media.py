"""TokenizerActor with images: a media message becomes a Tokenized whose MediaInputs hold the
patches in shared memory and the placeholder spans; bad media is a 400 Error; marker text the
client wrote is not an image."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers.vision_images import mp4, png

from m3serve.actors.tokenizer import TokenizerActor
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.model.vision.processor import process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig
from m3serve.runtime.messages import (
    Error,
    GenerateReq,
    MediaBlob,
    SamplingParams,
    Tokenized,
    TokenizeReq,
    TokenizeResult,
)
from m3serve.runtime.shm import list_session_segments, new_session_id, read_array, unpack_token_ids
from m3serve.runtime.transport import InProcChannel

SPEC = TinySpec(dtype="float32", seed=1)


@pytest.fixture
def wired(tiny_checkpoint: Callable[[TinySpec], Path]):
    sched, api = InProcChannel(), InProcChannel()
    session = new_session_id()
    actor = TokenizerActor(
        InProcChannel().inbox(),
        scheduler=sched.outbox(),
        api=api.outbox(),
        control=None,
        model_dir=tiny_checkpoint(SPEC),
        worker=0,
        session=session,
        context_length=100_000,
        max_image_pixels=4_000_000,
    )
    return actor, sched.inbox(), api.inbox(), session


def image_request(rid: str, blobs: list[bytes], text: str = "describe") -> GenerateReq:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image", "media": i} for i in range(len(blobs))]
    return GenerateReq(
        rid=rid,
        messages=[{"role": "user", "content": parts}],
        sampling=SamplingParams(max_new_tokens=4),
        media=[MediaBlob("image", b) for b in blobs],
    )


async def next_message(inbox) -> object:
    return await asyncio.wait_for(inbox.recv(), 20)


async def test_images_become_media_inputs_with_spans_and_pixels(wired) -> None:
    actor, sched, _, session = wired
    await actor.on_start()
    blobs = [png(56, 84, 1), png(120, 200, 2)]
    await actor.on_generate(image_request("img", blobs))
    message = await next_message(sched)
    assert isinstance(message, Tokenized)
    ids = unpack_token_ids(message.input_ids).tolist()
    image_id = actor.tokenizer.token_to_id("]<]image[>[")
    assert len(message.media) == 2
    config = ImageProcessorConfig()
    for item, blob in zip(message.media, blobs, strict=True):
        expected = process_image_bytes(blob, config)
        assert item.kind == "image" and item.grids == [expected.grid]
        ((offset, count),) = item.spans
        assert count == expected.tokens(2)
        assert ids[offset - 1] == actor.tokenizer.token_to_id("]<]start of image[>[")
        assert ids[offset : offset + count] == [image_id] * count
        assert ids[offset + count] == actor.tokenizer.token_to_id("]<]end of image[>[")
        pixels = read_array(item.pixels, np.float32).reshape(-1, 1176)
        assert np.array_equal(pixels, expected.pixels)
    assert ids.count(image_id) == sum(s[0][1] for s in (m.spans for m in message.media))
    assert message.media[0].content_hash != message.media[1].content_hash
    assert list_session_segments(session) == []


async def test_the_same_image_hashes_the_same(wired) -> None:
    actor, sched, _, _ = wired
    await actor.on_start()
    blob = png(90, 90, 4)
    for rid in ("a", "b"):
        await actor.on_generate(image_request(rid, [blob]))
    first, second = await next_message(sched), await next_message(sched)
    assert first.media[0].content_hash == second.media[0].content_hash
    for message in (first, second):
        read_array(message.media[0].pixels, np.float32)


async def test_bad_image_bytes_are_a_400_and_leave_no_segment(wired) -> None:
    actor, sched, api, session = wired
    await actor.on_start()
    await actor.on_generate(image_request("bad", [png(40, 40), b"\x89PNG garbage"]))
    error = await next_message(api)
    assert isinstance(error, Error) and error.rid == "bad" and error.code == 400
    assert "cannot decode the image" in error.message
    assert list_session_segments(session) == []
    # Nothing reached the scheduler for it: the next message there is the next request's.
    await actor.on_generate(image_request("good", [png(40, 40)]))
    message = await next_message(sched)
    assert message.rid == "good"
    read_array(message.media[0].pixels, np.float32)


async def test_too_many_pixels_is_a_400(wired) -> None:
    actor, _, api, _ = wired
    await actor.on_start()
    await actor.on_generate(image_request("huge", [png(2100, 2000)]))
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400
    assert "--max-image-pixels" in error.message


async def test_marker_text_in_user_content_is_not_an_image(wired) -> None:
    actor, sched, _, _ = wired
    await actor.on_start()
    req = image_request("m", [png(56, 56)], text="a literal ]<]image[>[ here")
    await actor.on_generate(req)
    message = await next_message(sched)
    ids = unpack_token_ids(message.input_ids).tolist()
    ((_, count),) = message.media[0].spans
    image_id = actor.tokenizer.token_to_id("]<]image[>[")
    assert ids.count(image_id) == count
    read_array(message.media[0].pixels, np.float32)


async def test_marker_text_without_media_is_plain_text(wired) -> None:
    actor, sched, _, _ = wired
    await actor.on_start()
    req = GenerateReq(rid="t", messages=[{"role": "user", "content": "see ]<]image[>[ !"}])
    await actor.on_generate(req)
    message = await next_message(sched)
    ids = unpack_token_ids(message.input_ids).tolist()
    assert actor.tokenizer.token_to_id("]<]image[>[") not in ids
    assert message.media == []
    text = actor.tokenizer.decode(ids, skip_special_tokens=False)
    assert "see ]<]image[>[ !" in text


async def test_more_images_than_parts_is_a_400(wired) -> None:
    actor, _, api, _ = wired
    await actor.on_start()
    req = image_request("n", [png(56, 56)])
    req.media.append(MediaBlob("image", png(56, 56)))
    await actor.on_generate(req)
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400
    assert "placeholders" in error.message


async def test_video_without_pyav_is_a_400(wired, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_av(name: str, *args, **kwargs):
        if name == "av":
            raise ImportError("no av")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_av)
    actor, _, api, _ = wired
    await actor.on_start()
    req = GenerateReq(
        rid="v",
        messages=[{"role": "user", "content": [{"type": "video", "media": 0}]}],
        media=[MediaBlob("video", b"\x00\x00\x00\x18ftypmp42")],
    )
    await actor.on_generate(req)
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400
    assert "PyAV" in error.message


async def test_a_video_has_one_timestamped_span_per_temporal_patch(wired) -> None:
    actor, sched, _, _ = wired
    await actor.on_start()
    req = GenerateReq(
        rid="vid",
        messages=[{"role": "user", "content": [{"type": "video", "media": 0}]}],
        media=[MediaBlob("video", mp4(count=24, fps=4, h=64, w=96))],  # 6 s
    )
    await actor.on_generate(req)
    message = await next_message(sched)
    assert isinstance(message, Tokenized), message
    (video,) = message.media
    assert video.kind == "video" and video.grids == [(3, 4, 6)]
    assert [count for _, count in video.spans] == [6, 6, 6]
    ids = unpack_token_ids(message.input_ids).tolist()
    video_id = actor.tokenizer.token_to_id("]<]video[>[")
    assert ids.count(video_id) == 18
    text = actor.tokenizer.decode(ids, skip_special_tokens=False)
    for stamp in ("]<]0.0 seconds[>[", "]<]2.0 seconds[>[", "]<]4.0 seconds[>["):
        assert stamp in text
    pixels = read_array(video.pixels, np.float32)
    assert pixels.size == 3 * 4 * 6 * 1176  # temporal patches x grid, one row per patch


async def test_a_model_without_a_vision_config_refuses_media(
    tiny_checkpoint: Callable[[TinySpec], Path], tmp_path: Path
) -> None:
    text_only = tmp_path / "text-only"
    shutil.copytree(tiny_checkpoint(SPEC), text_only)
    config = json.loads((text_only / "config.json").read_text())
    config.pop("vision_config")
    (text_only / "config.json").write_text(json.dumps(config))
    api = InProcChannel()
    actor = TokenizerActor(
        InProcChannel().inbox(),
        scheduler=InProcChannel().outbox(),
        api=api.outbox(),
        control=None,
        model_dir=text_only,
        worker=0,
        session=new_session_id(),
    )
    await actor.on_start()
    await actor.on_generate(image_request("x", [png(56, 56)]))
    error = await next_message(api.inbox())
    assert isinstance(error, Error) and error.code == 400
    assert "no vision tower" in error.message


async def test_tokenize_gives_the_ids_generation_sees(wired) -> None:
    actor, sched, api, _ = wired
    await actor.on_start()
    blobs = [png(56, 84, 1), png(120, 200, 2)]
    req = image_request("gen", blobs, text="a literal ]<]image[>[ here")
    await actor.on_generate(req)
    generated = await next_message(sched)
    await actor.on_tokenize(TokenizeReq(rid="tok", messages=req.messages, media=req.media))
    reply = await next_message(api)
    assert isinstance(reply, TokenizeResult)
    assert reply.token_ids == unpack_token_ids(generated.input_ids).tolist()
    for item in generated.media:
        read_array(item.pixels, np.float32)


async def test_tokenize_with_bad_image_bytes_is_a_400(wired) -> None:
    actor, _, api, session = wired
    await actor.on_start()
    req = image_request("bad", [b"\x89PNG garbage"])
    await actor.on_tokenize(TokenizeReq(rid="bad", messages=req.messages, media=req.media))
    error = await next_message(api)
    assert isinstance(error, Error) and error.rid == "bad" and error.code == 400
    assert "cannot decode the image" in error.message
    assert list_session_segments(session) == []
