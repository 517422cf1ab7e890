"""A chat call for library users: messages (and tools) in, the answer out as a plain dict split
the way the API splits it — the same chat template (rendered by the tokenizer actor), the same
thinking controls and the same MiniMax reasoning and tool-call parsers."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from m3serve.engine.errors import RequestError
from m3serve.engine.media import MediaRefused, load_media
from m3serve.engine.requests import sampling
from m3serve.model.thinking import ThinkingInvalid, resolve_thinking
from m3serve.parsers import ReasoningParser, ToolCallParser
from m3serve.runtime.config import MediaArgs
from m3serve.runtime.messages import GenerateReq, MediaBlob


def chat_request(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampling_params: dict[str, Any],
    thinking: str | None,
    reasoning_effort: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    rid: str | None,
) -> GenerateReq:
    """The engine request; its thinking mode is resolved here, as the parsers need it too."""
    try:
        mode, effort = resolve_thinking(thinking, reasoning_effort, chat_template_kwargs)
    except ThinkingInvalid as exc:
        raise RequestError(str(exc)) from exc
    params = sampling(sampling_params)
    params.skip_special_tokens = False  # the parsers read the think and tool-call tags
    return GenerateReq(
        rid=rid or uuid.uuid4().hex,
        messages=messages,
        tools=tools,
        sampling=params,
        thinking=mode,
        reasoning_effort=effort,
        chat_template_kwargs=chat_template_kwargs,
    )


async def with_media(req: GenerateReq, args: MediaArgs) -> GenerateReq:
    """`req` with its messages' image_url / video_url parts loaded into `media` (as the API
    does); a refused part is a `RequestError`."""
    messages, media = await messages_media(req.messages or [], args)
    if not media:
        return req
    return msgspec.structs.replace(req, messages=messages, media=media)


async def messages_media(
    messages: list[dict[str, Any]], args: MediaArgs
) -> tuple[list[dict[str, Any]], list[MediaBlob]]:
    """`load_media` for library calls: a refused part is a `RequestError` naming it."""
    try:
        return await load_media(messages, args)
    except MediaRefused as exc:
        where = f" ({exc.param})" if exc.param else ""
        raise RequestError(exc.message + where) from exc


def parsed(result: dict[str, Any], req: GenerateReq) -> dict[str, Any]:
    """A generate result plus the answer split out of its text: `content`,
    `reasoning_content` (None when the model did not reason) and OpenAI-shaped `tool_calls`."""
    split = ReasoningParser(req.thinking or "adaptive").parse(result["text"])
    content, calls = split.content, []
    if req.tools:
        content, calls = ToolCallParser(req.tools).parse(content)
    return {
        **result,
        "content": content,
        "reasoning_content": split.reasoning or None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
