"""POST /v1/chat/completions: OpenAI chat, streamed (SSE) or not, with MiniMax reasoning and
tool calls parsed out of the model's text, thinking controls, n choices and logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3serve.api.choice import ChoiceOutput, Delta
from m3serve.api.errors import APIError, decode, read_body
from m3serve.api.parsers.reasoning import ReasoningParser
from m3serve.api.parsers.tools import ToolCallParser
from m3serve.api.protocol import ChatCompletionRequest, Message
from m3serve.api.responses import (
    EventStream,
    finish_reason,
    logprobs_content,
    sse,
    sse_events,
    usage_dict,
)
from m3serve.api.serving import (
    ClientGone,
    ServerState,
    Timing,
    check_n,
    collect,
    log_exchange,
    merged,
    observe_finished,
    sampling_params,
    start,
    to_builtins,
    until_disconnect,
)
from m3serve.model.special_tokens import THINK_END, TOOL_CALL_START, TOOL_NAMESPACE
from m3serve.model.thinking import ThinkingInvalid, resolve_thinking
from m3serve.runtime.messages import GenerateReq, RequestOutput

MEDIA_PARTS = ("image_url", "image", "video_url", "video", "input_audio")


@dataclass
class Plan:
    """A validated chat request, ready to submit."""

    reqs: list[GenerateReq]
    thinking: str
    tools: list[dict[str, Any]] | None
    forced_prefix: str
    body: ChatCompletionRequest


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.args.max_request_bytes)
    body = decode(raw, ChatCompletionRequest)
    plan = _plan(body, state)
    rid = "chatcmpl-" + uuid.uuid4().hex
    log_exchange(state, rid, "request", raw.decode(errors="replace"))
    timing = Timing()
    streams = await start(state.engine, plan.reqs)
    outputs = [_choice_output(plan, state) for _ in plan.reqs]
    if body.stream:
        finished: list[list[RequestOutput]] = [[] for _ in streams]
        events = _stream(rid, plan, state, streams, outputs, timing, finished)
        return EventStream(sse_events(events, state, finished))
    try:
        chunks = await until_disconnect(request, collect(streams))
    except ClientGone:
        state.metrics.observe_aborted()
        return Response(status_code=499)
    response = _completion(rid, plan, state, outputs, chunks, timing)
    log_exchange(state, rid, "response", response["choices"])
    return JSONResponse(response)


# ---------------------------------------------------------------------- validation


def _plan(body: ChatCompletionRequest, state: ServerState) -> Plan:
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages")
    check_n(body)
    _check_content(body.messages)
    try:
        thinking, effort = resolve_thinking(
            body.thinking.type if body.thinking else None,
            body.reasoning_effort,
            body.chat_template_kwargs,
        )
    except ThinkingInvalid as exc:
        param = "reasoning_effort" if str(exc).startswith("reasoning_effort") else "thinking"
        raise APIError(400, str(exc), param) from exc
    tools = [to_builtins(t) for t in body.tools] if body.tools else None
    forced = ""
    if tools and body.tool_choice not in (None, "auto", "none"):
        forced, thinking, effort = _forced_call(body, tools), "disabled", None
    if body.tool_choice == "none":
        tools = None
    if body.logprobs and body.top_logprobs is None:
        body.top_logprobs = 0
    template_kwargs = {
        k: v
        for k, v in (body.chat_template_kwargs or {}).items()
        if k not in ("thinking", "thinking_mode", "reasoning_effort")
    }
    messages = [to_builtins(m) for m in body.messages]
    parsing = state.args.reasoning_parser is not None or state.args.tool_call_parser is not None
    reqs = [
        GenerateReq(
            rid=f"{uuid.uuid4().hex}-{i}",
            messages=messages,
            tools=tools,
            sampling=sampling_params(
                body,
                state,
                _max_tokens(body),
                logprobs=body.logprobs,
                top_logprobs=body.top_logprobs or 0,
                # The parsers need the <mm:think> and tool-call tokens in the text.
                skip_special_tokens=not parsing,
                seed_offset=i,
            ),
            stream=body.stream,
            thinking=thinking,
            reasoning_effort=effort,
            chat_template_kwargs=template_kwargs or None,
            assistant_prefix=((THINK_END if forced else "") + forced) or None,
        )
        for i in range(body.n)
    ]
    return Plan(reqs, thinking, tools, forced, body)


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    # max_completion_tokens replaces max_tokens; an explicit 0 must be refused, not ignored.
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def _check_content(messages: list[Message]) -> None:
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for part in message.content:
                kind = part.get("type")
                if kind in MEDIA_PARTS:
                    raise APIError(
                        400, f"{kind} input is not supported by this build yet", f"messages.{i}"
                    )
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"unsupported content part {kind!r}", f"messages.{i}")
        if message.role == "tool" and message.content is None:
            raise APIError(400, "a tool message needs content", f"messages.{i}")


def _forced_call(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> str:
    """The start of the tool call the model must continue (tool_choice required / named)."""
    opening = f'{TOOL_CALL_START}\n{TOOL_NAMESPACE}<invoke name="'
    if body.tool_choice == "required":
        return opening
    name = body.tool_choice.function.name  # type: ignore[union-attr]
    if name not in {t.get("function", t).get("name") for t in tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return f'{opening}{name}">'


def _choice_output(plan: Plan, state: ServerState) -> ChoiceOutput:
    reasoning = None
    if state.args.reasoning_parser and plan.body.separate_reasoning:
        reasoning = ReasoningParser(plan.thinking)
    tools = None
    if state.args.tool_call_parser and plan.tools:
        tools = ToolCallParser(plan.tools)
    return ChoiceOutput(reasoning, tools, plan.forced_prefix, plan.body.parallel_tool_calls)


# ---------------------------------------------------------------------- non-streaming


def _completion(
    rid: str,
    plan: Plan,
    state: ServerState,
    outputs: list[ChoiceOutput],
    chunks: list[list[RequestOutput]],
    timing: Timing,
) -> dict[str, Any]:
    choices = []
    for index, (output, pieces) in enumerate(zip(outputs, chunks, strict=True)):
        for chunk in pieces:
            output.feed(chunk.text, len(chunk.output_ids))
        output.finish()
        calls = output.calls
        message: dict[str, Any] = {"role": "assistant", "content": output.text.content or None}
        if output.reasoning is not None:
            message["reasoning_content"] = output.text.reasoning or None
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        elif message["content"] is None:
            message["content"] = ""
        finish = pieces[-1].finish
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs_content(state, pieces) if plan.body.logprobs else None,
                "finish_reason": finish_reason(finish, bool(calls)),
            }
        )
        observe_finished(state, pieces, timing)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": usage_dict(chunks, _reasoning_counts(outputs)),
    }


# ---------------------------------------------------------------------- streaming


async def _stream(
    rid: str,
    plan: Plan,
    state: ServerState,
    streams: list[AsyncIterator[RequestOutput]],
    outputs: list[ChoiceOutput],
    timing: Timing,
    finished: list[list[RequestOutput]],
) -> AsyncIterator[bytes]:
    """The response's SSE events; `finished` collects each choice's chunks as they pass."""
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created}
    head["model"] = state.model_name
    include_usage = bool(plan.body.stream_options and plan.body.stream_options.include_usage)
    for index in range(len(streams)):
        yield sse({**head, "choices": [_choice(index, {"role": "assistant", "content": ""})]})
    async for index, chunk in merged(streams):
        timing.token()
        finished[index].append(chunk)
        output = outputs[index]
        delta = output.feed(chunk.text, len(chunk.output_ids))
        if chunk.finish is not None:
            tail = output.finish()
            delta = Delta(
                delta.reasoning + tail.reasoning,
                delta.content + tail.content,
                delta.calls + tail.calls,
            )
        body = _delta_dict(delta)
        logprobs = None
        if plan.body.logprobs and chunk.logprobs:
            logprobs = logprobs_content(state, [chunk])
        reason = None
        if chunk.finish is not None:
            reason = finish_reason(chunk.finish, bool(output.calls))
            observe_finished(state, finished[index], timing)
        if body or reason or logprobs:
            yield sse({**head, "choices": [_choice(index, body, reason, logprobs)]})
    log_exchange(state, rid, "streamed", [o.text for o in outputs])
    if include_usage:
        usage = usage_dict(finished, _reasoning_counts(outputs))
        yield sse({**head, "choices": [], "usage": usage})


def _reasoning_counts(outputs: list[ChoiceOutput]) -> list[int] | None:
    if outputs[0].reasoning is None:
        return None
    return [o.reasoning_tokens for o in outputs]


def _choice(
    index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _delta_dict(delta: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.calls:
        out["tool_calls"] = [_call_delta(c) for c in delta.calls]
    return out


def _call_delta(call: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
    if call.id is not None:
        out["id"] = call.id
        out["type"] = "function"
    if call.name is not None:
        out["function"]["name"] = call.name
    return out
