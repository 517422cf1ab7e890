"""TokenizerActor in isolation, wired to in-process mailboxes: what it sends the scheduler for
long and short prompts, chat rendering with thinking controls, and refusals."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from m3serve.actors.prompt import THREAD_MIN_CHARS
from m3serve.actors.tokenizer import TokenizerActor
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.codec import Codec
from m3serve.runtime.messages import (
    DetokenizeReq,
    DetokenizeResult,
    Error,
    GenerateReq,
    SamplingParams,
    Tokenized,
    TokenizeReq,
    TokenizeResult,
    ToScheduler,
)
from m3serve.runtime.shm import list_session_segments, new_session_id, unpack_token_ids
from m3serve.runtime.transport import Inbox, InProcChannel

SPEC = TinySpec(dtype="float32", seed=1)


@pytest.fixture
def wired(tiny_checkpoint: Callable[[TinySpec], Path]):
    path = tiny_checkpoint(SPEC)
    sched, api = InProcChannel(), InProcChannel()
    session = new_session_id()
    actor = TokenizerActor(
        InProcChannel().inbox(),
        scheduler=sched.outbox(),
        api=api.outbox(),
        control=None,
        model_dir=path,
        worker=0,
        session=session,
        context_length=1_000_000,
    )
    return actor, sched.inbox(), api.inbox(), path, session


def long_text(tokenizer: Tokenizer, at_least: int) -> str:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tool", "café", "日本", "42", "{", "}"]
    # The tiny vocabulary spends about 4 tokens per word.
    text = " ".join(rng.choice(words) for _ in range(at_least // 3))
    assert len(tokenizer.encode(text, add_special_tokens=False).ids) >= at_least
    return text


async def next_message(inbox: Inbox) -> object:
    return await asyncio.wait_for(inbox.recv(), 10)


async def test_a_100k_token_prompt_goes_to_the_scheduler_through_shared_memory(wired) -> None:
    actor, sched, _, _, session = wired
    await actor.on_start()
    text = long_text(actor.tokenizer, 100_000)
    req = GenerateReq(rid="big", prompt=text, sampling=SamplingParams(max_new_tokens=1))
    await actor.on_generate(req)
    message = await next_message(sched)
    assert isinstance(message, Tokenized)
    assert message.input_ids.shm is not None and message.input_ids.array is None
    frames = Codec(ToScheduler).encode(message)
    wire_bytes = sum(memoryview(frame).nbytes for frame in frames)
    assert wire_bytes < 1024, f"{wire_bytes} bytes on the wire: the ids went inline"
    expected = actor.tokenizer.encode(text, add_special_tokens=False).ids
    assert message.input_ids.count == len(expected) >= 100_000
    assert unpack_token_ids(message.input_ids).tolist() == expected
    assert list_session_segments(session) == []  # the reader unlinked it


async def test_a_short_prompt_travels_inline(wired) -> None:
    actor, sched, _, _, _ = wired
    await actor.on_start()
    await actor.on_generate(GenerateReq(rid="small", prompt="hello there"))
    message = await next_message(sched)
    assert message.input_ids.shm is None and message.input_ids.array is not None


@pytest.mark.parametrize(
    ("thinking", "effort", "suffix"),
    [
        ("enabled", None, "<mm:think>"),
        ("disabled", None, "</mm:think>"),
        (None, "none", "</mm:think>"),
    ],
)
async def test_chat_requests_render_thinking_controls(wired, thinking, effort, suffix) -> None:
    actor, sched, _, _, _ = wired
    await actor.on_start()
    req = GenerateReq(
        rid="chat",
        messages=[{"role": "user", "content": "hi"}],
        thinking=thinking,
        reasoning_effort=effort,
    )
    await actor.on_generate(req)
    message = await next_message(sched)
    text = actor.tokenizer.decode(
        unpack_token_ids(message.input_ids).tolist(), skip_special_tokens=False
    )
    assert text.endswith("]~b]ai\n" + suffix)


async def test_reasoning_effort_reaches_the_template(wired) -> None:
    actor, sched, _, _, _ = wired
    await actor.on_start()
    req = GenerateReq(
        rid="e", messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
    )
    await actor.on_generate(req)
    message = await next_message(sched)
    text = actor.tokenizer.decode(unpack_token_ids(message.input_ids).tolist())
    assert "<effort>high</effort>" in text


@pytest.mark.parametrize(
    ("req", "fragment"),
    [
        (GenerateReq(rid="a", prompt=""), "empty"),
        (GenerateReq(rid="b"), "needs a prompt"),
        (GenerateReq(rid="c", prompt="x", sampling=SamplingParams(top_p=0.0)), "top_p"),
        (
            GenerateReq(rid="d", messages=[{"role": "user", "content": "x"}], thinking="maybe"),
            "thinking must be one of",
        ),
        (
            GenerateReq(rid="e", prompt="x", sampling=SamplingParams(max_new_tokens=2_000_000)),
            "exceeds the context length",
        ),
    ],
)
async def test_bad_requests_get_a_400_and_never_reach_the_scheduler(wired, req, fragment) -> None:
    actor, _, api, _, _ = wired
    await actor.on_start()
    await actor.on_generate(req)
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400 and fragment in error.message
    assert actor.pending == {}


class Spy:
    """The actor's tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded: list[int] = []

    def encode(self, text: str, **kwargs: object) -> object:
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def encode_batch(self, texts: list[str], **kwargs: object) -> object:
        self.encoded.extend(len(t) for t in texts)
        return self.tokenizer.encode_batch(texts, **kwargs)


@pytest.mark.parametrize("kind", ["generate", "tokenize"])
async def test_a_prompt_over_max_prompt_chars_never_reaches_the_tokenizer(wired, kind) -> None:
    actor, _, api, _, _ = wired
    await actor.on_start()
    assert actor.prompts.max_prompt_chars == 16 * 1_000_000  # the default: per token of context
    actor.prompts.max_prompt_chars = 1000
    actor.prompts.tokenizer = spy = Spy(actor.tokenizer)
    word = "a" * 1001  # one word: the tokenizer's worst case
    if kind == "generate":
        await actor.on_generate(GenerateReq(rid="w", prompt=word))
    else:
        await actor.on_tokenize(TokenizeReq(rid="w", prompt=word))
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400 and error.rid == "w"
    assert "1001 characters" in error.message and "--max-prompt-chars" in error.message
    assert spy.encoded == []
    await actor.on_tokenize(TokenizeReq(rid="ok", prompt=word[:1000]))
    assert isinstance(await next_message(api), TokenizeResult)
    assert spy.encoded == [1000]


async def test_tokenize_and_detokenize_round_trip_in_the_worker(wired) -> None:
    actor, _, api, _, _ = wired
    await actor.on_start()
    text = long_text(actor.tokenizer, 50_000)
    assert len(text) >= THREAD_MIN_CHARS  # encoded on a thread
    await actor.on_tokenize(TokenizeReq(rid="t", prompt=text))
    tokens = await next_message(api)
    assert isinstance(tokens, TokenizeResult) and tokens.rid == "t"
    assert tokens.token_ids == actor.tokenizer.encode(text, add_special_tokens=False).ids
    await actor.on_detokenize(DetokenizeReq("d", tokens.token_ids))
    back = await next_message(api)
    assert back == DetokenizeResult("d", text)


async def test_tokenize_renders_chat_messages(wired) -> None:
    actor, _, api, _, _ = wired
    await actor.on_start()
    messages = [{"role": "user", "content": "hi"}]
    await actor.on_tokenize(TokenizeReq(rid="m", messages=messages))
    tokens = await next_message(api)
    text = actor.tokenizer.decode(tokens.token_ids, skip_special_tokens=False)
    assert "hi" in text and text.endswith("]~b]ai\n")


async def test_detokenize_refuses_ids_outside_the_vocabulary(wired) -> None:
    actor, _, api, _, _ = wired
    await actor.on_start()
    await actor.on_detokenize(DetokenizeReq("d", [1, actor.facts.vocab_size]))
    error = await next_message(api)
    assert isinstance(error, Error) and error.code == 400 and "vocabulary" in error.message
