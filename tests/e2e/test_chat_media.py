"""Images through the real engine (single process, tiny checkpoint) over HTTP: a data: URL image
is accepted and its placeholder tokens count in usage.prompt_tokens; undecodable image bytes and
a video without PyAV are 400s before anything streams; the library `chat` takes the same parts."""

from __future__ import annotations

import base64
import builtins
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.vision_images import png

from m3serve import AsyncEngine, RequestError
from m3serve.api.app import create_app
from m3serve.model.vision.processor import process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig
from m3serve.runtime.config import ServerArgs

CHAT = "/v1/chat/completions"
IMAGE = png(56, 84)


def data_url(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


def ask(part: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    if part is not None:
        content.append(part)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
    return {**body, "temperature": 0, **fields}


@contextlib.asynccontextmanager
async def served(model_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    args = ServerArgs.from_kwargs(
        model_path=str(model_path), single_process=True, max_total_tokens=4096
    )
    app = create_app(AsyncEngine(args), own_engine=True)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client,
    ):
        yield client


async def test_an_image_is_answered_and_its_tokens_are_counted(model_path: Path) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}
    async with served(model_path) as client:
        plain = await client.post(CHAT, json=ask(None))
        with_image = await client.post(CHAT, json=ask(part))
        streamed = await client.post(CHAT, json=ask(part, stream=True))
        bad = await client.post(
            CHAT, json=ask({"type": "image_url", "image_url": {"url": data_url(b"garbage")}})
        )
    assert plain.status_code == 200 and with_image.status_code == 200, with_image.text
    tokens = process_image_bytes(IMAGE, ImageProcessorConfig()).tokens(2)
    grown = with_image.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert grown == tokens + 2  # start + placeholders + end
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "cannot decode the image" in error["message"]


async def test_a_video_without_pyav_is_a_400(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_av(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "av":
            raise ImportError("no av here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_av)
    part = {"type": "video_url", "video_url": {"url": data_url(b"\x00\x00", "video/mp4")}}
    async with served(model_path) as client:
        response = await client.post(CHAT, json=ask(part, stream=True))
    assert response.status_code == 400
    assert "PyAV" in response.json()["error"]["message"]


async def test_library_chat_takes_image_parts(model_path: Path) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}
    messages = ask(part)["messages"]
    async with await AsyncEngine.create(
        str(model_path), single_process=True, max_total_tokens=4096
    ) as engine:
        result = await engine.chat(messages, temperature=0, max_new_tokens=2)
        tokenized = await engine.tokenize(messages=messages)  # loads the image_url part itself
        with pytest.raises(RequestError, match="loopback"):
            remote = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
            await engine.chat(ask(remote)["messages"], max_new_tokens=2)
    assert len(tokenized) == result["meta_info"]["prompt_tokens"]
    assert result["meta_info"]["prompt_tokens"] > process_image_bytes(
        IMAGE, ImageProcessorConfig()
    ).tokens(2)


async def test_tokenize_expands_an_image_as_chat_counts_it(model_path: Path) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}
    messages = ask(part)["messages"]
    async with served(model_path) as client:
        chat = await client.post(CHAT, json=ask(part))
        tokenized = await client.post("/v1/tokenize", json={"messages": messages})
        marker = await client.post("/v1/tokenize", json={"prompt": "]<]image[>["})
        bad_part = {"type": "image_url", "image_url": {"url": data_url(b"garbage")}}
        bad = await client.post("/v1/tokenize", json={"messages": ask(bad_part)["messages"]})
        remote = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
        refused = await client.post("/v1/tokenize", json={"messages": ask(remote)["messages"]})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == chat.json()["usage"]["prompt_tokens"]
    tokens = process_image_bytes(IMAGE, ImageProcessorConfig()).tokens(2)
    assert body["tokens"].count(marker.json()["tokens"][0]) == tokens
    assert bad.status_code == 400 and "cannot decode the image" in bad.json()["error"]["message"]
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages.0.content.1"
