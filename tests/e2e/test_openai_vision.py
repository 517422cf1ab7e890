"""Images through the official `openai` SDK against a live `m3serve serve` on the tiny
checkpoint with its vision tower: an image question streams an answer; two different images
with the same text give different answers and share no cached tokens past the text before them,
while the same image again is served from the prefix cache."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import openai
from helpers.sdk_server import sdk_fixtures
from helpers.vision_images import png

from m3serve.model.vision.processor import process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig

# Two images of one size (the same placeholder count) and different content.
NOISE = png(84, 112, seed=1)
OTHER = png(84, 112, seed=2)
TOKENS = process_image_bytes(NOISE, ImageProcessorConfig()).tokens(2)
QUESTION = "What is in this picture?"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


def image_part(blob: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(blob).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def ask(blob: bytes) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(blob)]}]


server, client, http = sdk_fixtures("module")


def test_an_image_question_streams_an_answer(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=ask(NOISE),
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(
        (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas
    )
    assert text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.prompt_tokens > TOKENS + 2


def _image_offset(http: httpx.Client, blob: bytes) -> int:
    """Where the image's placeholder run starts in the prompt (/v1/tokenize expands it as
    generation does)."""
    rendered = http.post("/v1/tokenize", json={"messages": ask(blob)}).json()["tokens"]
    marker = http.post("/v1/tokenize", json={"prompt": "]<]image[>["}).json()["tokens"]
    assert rendered.count(marker[0]) == TOKENS
    return rendered.index(marker[0])


def test_different_images_differ_and_share_no_cache(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    plain = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    text_only = client.chat.completions.create(model="m", messages=plain, **GREEDY)
    counted = http.post("/v1/tokenize", json={"messages": plain}).json()["count"]
    # /v1/tokenize renders the prompt as chat does, so its positions are the prompt's.
    assert counted == text_only.usage.prompt_tokens
    offset = _image_offset(http, NOISE)

    first = client.chat.completions.create(model="m", messages=ask(NOISE), **GREEDY)
    other = client.chat.completions.create(model="m", messages=ask(OTHER), **GREEDY)
    again = client.chat.completions.create(model="m", messages=ask(NOISE), **GREEDY)

    assert (
        first.usage.prompt_tokens
        == other.usage.prompt_tokens
        == text_only.usage.prompt_tokens + TOKENS + 2
    )
    answer = [r.choices[0].message.content or "" for r in (first, other)]
    reasoning = [
        getattr(r.choices[0].message, "reasoning_content", None) or "" for r in (first, other)
    ]
    assert (answer[0], reasoning[0]) != (answer[1], reasoning[1])
    # The other image reuses at most the text before its placeholders ...
    assert other.usage.prompt_tokens_details.cached_tokens <= offset
    # ... while the same image again is served from the cache past its placeholders.
    assert again.usage.prompt_tokens_details.cached_tokens >= offset + TOKENS - 4
    assert again.choices[0].message.content == first.choices[0].message.content
    counted = http.post("/v1/tokenize", json={"messages": ask(NOISE)}).json()["count"]
    assert counted == first.usage.prompt_tokens
