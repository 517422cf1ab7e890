"""The scheduler actor takes `Tokenized.media` as the tokenizer sends it: the pixels come out of
shared memory (every segment freed), the request is served with its image, and media that
cannot be read or served is a 400 for that request alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from conftest import M31_SPEC
from helpers.vision import ImagePrompt, image_prompt

from m3serve.actors.scheduler import SchedulerActor
from m3serve.core.engine_core import EngineCore
from m3serve.model.generate import generate
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import Error, SamplingParams, TokenBatch, Tokenized
from m3serve.runtime.shm import attach_segment, new_session_id, pack_token_ids, unlink_segment
from m3serve.runtime.transport import InProcChannel

VOCAB = M31_SPEC.vocab_size


class Sent:
    """An outbox that keeps what it is sent."""

    def __init__(self) -> None:
        self.messages: list[object] = []

    async def send(self, msg: object) -> None:
        self.messages.append(msg)


@pytest.fixture(scope="module")
def core(tiny_checkpoint: Callable) -> Iterator[EngineCore]:
    path = tiny_checkpoint(M31_SPEC)
    args = ServerArgs.from_kwargs(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=512
    )
    engine = EngineCore(args, path)
    yield engine
    engine.close()


def _actor(core: EngineCore) -> tuple[SchedulerActor, Sent]:
    sent = Sent()
    args = ServerArgs.from_kwargs(model_path=str(core.loaded.path), device="cpu")
    actor = SchedulerActor(InProcChannel().inbox(), [sent], None, args, core.loaded.path)
    actor.core = core
    return actor, sent


def _tokenized(rid: str, prompt: ImagePrompt, media: list) -> Tokenized:
    return Tokenized(
        rid=rid,
        input_ids=pack_token_ids(prompt.ids, new_session_id()),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
        stop_token_ids=[],
        max_new_tokens=6,
        fit_to_pool=False,
        worker=0,
        media=media,
    )


async def _serve(actor: SchedulerActor, msg: Tokenized) -> None:
    await actor.on_tokenized(msg)
    core = actor.core
    assert core is not None
    while core.has_work:
        await actor._emit(await core.step())


def test_an_image_request_is_served_and_its_segments_freed(core: EngineCore) -> None:
    actor, sent = _actor(core)
    prompt = image_prompt(5, VOCAB, [(1, 4, 6), (1, 2, 2)], [3, 8, 20])
    media = prompt.media_inputs()
    asyncio.run(_serve(actor, _tokenized("img", prompt, media)))
    for item in media:
        with pytest.raises(FileNotFoundError):
            attach_segment(item.pixels.name)
    tokens = [
        t for b in sent.messages if isinstance(b, TokenBatch) for ids in b.new_ids for t in ids
    ]
    assert core.model.vision is not None
    embeds = prompt.embeds(core.model.vision.encode(prompt.pixels, prompt.grids))
    assert tokens == generate(core.model, prompt.ids, 6, embeds=embeds)


def test_media_that_cannot_be_read_or_served_is_a_400_for_that_request(core: EngineCore) -> None:
    actor, sent = _actor(core)
    prompt = image_prompt(6, VOCAB, [(1, 2, 2)], [3, 8])
    lost = [prompt.media_inputs()[0]]
    unlink_segment(attach_segment(lost[0].pixels.name))  # gone before the engine reads it
    wrong = prompt.media_inputs()
    wrong[0] = type(wrong[0])("image", wrong[0].pixels, [(1, 4, 4)], wrong[0].spans, 1)

    async def go() -> None:
        await actor.on_tokenized(_tokenized("lost", prompt, lost))
        await actor.on_tokenized(_tokenized("wrong", prompt, wrong))

    asyncio.run(go())
    errors = {m.rid: m for m in sent.messages if isinstance(m, Error)}
    assert errors["lost"].code == errors["wrong"].code == 400
    assert "cannot read the pixels" in errors["lost"].message
    assert "pixel values" in errors["wrong"].message
    assert not core.has_work
