"""POST /v1/chat/completions: OpenAI chat, streamed (SSE) or not, with MiniMax reasoning and
tool calls parsed out of the model's text, thinking controls, n choices and logprobs.

This module validates a chat request into engine requests and renders the chat response
format; the requests' life (submit, stream, abort, metrics) is the `Generation`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from m3serve.api.bodies import finish_reason, logprobs_content, running_usage, usage_dict
from m3serve.api.choice import ChoiceOutput, Delta
from m3serve.api.constraints import response_format_constraint, tool_choice_constraint
from m3serve.api.errors import APIError, decode, read_body
from m3serve.api.generation import Generation, Outputs
from m3serve.api.protocol import ChatCompletionRequest, Message, to_builtins
from m3serve.api.sampling import check_n, sampling_params
from m3serve.api.state import ServerState
from m3serve.engine.media import MediaRefused, is_media_part, load_media, parse_part
from m3serve.model.thinking import ThinkingInvalid, resolve_thinking
from m3serve.parsers.reasoning import ReasoningParser
from m3serve.parsers.tools import ToolCall, ToolCallDelta, ToolCallParser
from m3serve.runtime.messages import Constraint, GenerateReq, MediaBlob, RequestOutput, Usage

# Media parts this server does not take (image_url and video_url it does).
MEDIA_PARTS = ("image", "video", "input_audio")
THINKING_KEYS = ("thinking", "thinking_mode", "reasoning_effort")  # not for the template


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.args.max_request_bytes)
    body = decode(raw, ChatCompletionRequest)
    plan = _plan(body, state)
    # Only now, with the whole request valid, is any media loaded.
    messages, media = await _load_media(plan, state)
    reqs = _requests(plan, state, messages, media)
    rid = "chatcmpl-" + uuid.uuid4().hex
    state.log_exchange(rid, "request", raw.decode(errors="replace"))
    response = _ChatResponse(rid, plan, state)
    generation = await Generation.start(state, rid, reqs, request)
    if body.stream:
        return generation.event_stream(response.chunks(generation))
    return await generation.json_response(request, response.completion)


# ---------------------------------------------------------------------- validation


@dataclass
class Plan:
    """A validated chat request: what its engine requests and its parsers are made from."""

    body: ChatCompletionRequest
    thinking: str
    effort: str | None
    tools: list[dict[str, Any]] | None
    constraint: Constraint | None  # the response_format or the call tool_choice forces


def _plan(body: ChatCompletionRequest, state: ServerState) -> Plan:
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages")
    check_n(body)
    _check_content(body.messages)
    thinking, effort = _thinking(body)
    tools = [to_builtins(t) for t in body.tools] if body.tools else None
    constraint = _constraint(body, tools, state)
    if constraint is not None:
        # The grammar constrains the answer from its first token: thinking would come before
        # it, so a constrained request runs with thinking off (the template then starts the
        # answer right after </mm:think>).
        thinking, effort = "disabled", None
    if body.tool_choice == "none":
        tools = None
    if body.logprobs and body.top_logprobs is None:
        body.top_logprobs = 0
    return Plan(body, thinking, effort, tools, constraint)


def _constraint(
    body: ChatCompletionRequest, tools: list[dict[str, Any]] | None, state: ServerState
) -> Constraint | None:
    specials = None
    if state.tokenizer is not None:
        added = state.tokenizer.get_added_tokens_decoder().items()
        specials = {token.content: i for i, token in added if token.special}
    forced = tool_choice_constraint(body, tools or [], specials)
    response = response_format_constraint(body.response_format)
    # A forced call is the whole output: the answer format has no text to shape (as OpenAI,
    # which accepts both; agent SDKs send their output type with every turn).
    return forced or response


def _thinking(body: ChatCompletionRequest) -> tuple[str, str | None]:
    try:
        return resolve_thinking(
            body.thinking.type if body.thinking else None,
            body.reasoning_effort,
            body.chat_template_kwargs,
        )
    except ThinkingInvalid as exc:
        param = "reasoning_effort" if str(exc).startswith("reasoning_effort") else "thinking"
        raise APIError(400, str(exc), param) from exc


async def _load_media(
    plan: Plan, state: ServerState
) -> tuple[list[dict[str, Any]], list[MediaBlob]]:
    messages = [to_builtins(m) for m in plan.body.messages]
    try:
        return await load_media(messages, state.engine.args.media)
    except MediaRefused as exc:
        raise APIError(400, exc.message, exc.param) from exc


def _requests(
    plan: Plan, state: ServerState, messages: list[dict[str, Any]], media: list[MediaBlob]
) -> list[GenerateReq]:
    """One engine request per choice; they differ only in id and seed."""
    body = plan.body
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in THINKING_KEYS}
    parsing = state.args.reasoning_parser is not None or state.args.tool_call_parser is not None
    return [
        GenerateReq(
            rid=f"{uuid.uuid4().hex}-{i}",
            messages=messages,
            tools=plan.tools,
            sampling=sampling_params(
                body,
                state.defaults,
                _max_tokens(body),
                logprobs=body.logprobs,
                top_logprobs=body.top_logprobs or 0,
                # The parsers need the <mm:think> and tool-call tokens in the text.
                skip_special_tokens=not parsing,
                seed_offset=i,
                constraint=plan.constraint,
            ),
            stream=body.stream,
            thinking=plan.thinking,
            reasoning_effort=plan.effort,
            chat_template_kwargs=kwargs or None,
            media=media,
        )
        for i in range(body.n)
    ]


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    # max_completion_tokens replaces max_tokens; an explicit 0 must be refused, not ignored.
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def _check_content(messages: list[Message]) -> None:
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                _check_part(part, f"messages.{i}.content.{j}")
        if message.role == "tool" and message.content is None:
            raise APIError(400, "a tool message needs content", f"messages.{i}")


def _check_part(part: dict[str, Any], param: str) -> None:
    kind = part.get("type")
    if is_media_part(part):
        try:
            parse_part(part, param)
        except MediaRefused as exc:
            raise APIError(400, exc.message, exc.param) from exc
        return
    if kind in MEDIA_PARTS:
        hint = " (send images as image_url parts)" if kind == "image" else ""
        raise APIError(400, f"{kind} input is not supported{hint}", param)
    if kind != "text" or not isinstance(part.get("text"), str):
        raise APIError(400, f"unsupported content part {kind!r}", param)


# ---------------------------------------------------------------------- rendering


class _ChatResponse:
    """The chat response to one request: each choice's text through its own parsers, as one
    `chat.completion` or as `chat.completion.chunk` events. Made before the request is
    submitted, so that nothing it builds can fail once the engine is at work."""

    def __init__(self, rid: str, plan: Plan, state: ServerState) -> None:
        self.rid = rid
        self.plan = plan
        self.state = state
        self.parsed = [_choice_output(plan, state) for _ in range(plan.body.n)]

    def completion(self, outputs: Outputs) -> dict[str, Any]:
        choices = [self._message_choice(i, pieces) for i, pieces in enumerate(outputs)]
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.state.model_name,
            "choices": choices,
            "usage": usage_dict(outputs, self._reasoning_counts()),
        }

    async def chunks(self, generation: Generation) -> AsyncGenerator[dict[str, Any], None]:
        head = {"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time())}
        head["model"] = self.state.model_name
        options = self.plan.body.stream_options
        continuous = options is not None and options.continuous
        for index in range(len(self.parsed)):
            chunk = {**head, "choices": [_choice(index, {"role": "assistant", "content": ""})]}
            if continuous:  # nothing generated yet: the prompt's counts, as vLLM
                first = generation.choices[index].outputs[0].usage
                chunk["usage"] = running_usage(Usage(first.prompt_tokens, 0, first.cached_tokens))
            yield chunk
        async for index, output in generation.stream():
            choice = self._delta_choice(index, output)
            if choice is not None:
                chunk = {**head, "choices": [choice]}
                if continuous:  # tokens of pieces held back (no chunk) count in the next one
                    chunk["usage"] = running_usage(output.usage)
                yield chunk
        self.state.log_exchange(self.rid, "streamed", [o.text for o in self.parsed])
        if options and options.include_usage:
            usage = usage_dict(generation.outputs, self._reasoning_counts())
            yield {**head, "choices": [], "usage": usage}

    def _message_choice(self, index: int, pieces: list[RequestOutput]) -> dict[str, Any]:
        output = self.parsed[index]
        for piece in pieces:
            output.feed(piece.text, piece.output_ids)
        output.finish()
        calls = output.calls
        message: dict[str, Any] = {"role": "assistant", "content": output.text.content or None}
        if output.reasoning is not None:
            message["reasoning_content"] = output.text.reasoning or None
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
        elif message["content"] is None:
            message["content"] = ""
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs_content(self.state, pieces) if self.plan.body.logprobs else None,
            "finish_reason": finish_reason(pieces[-1].finish, bool(calls)),
        }

    def _delta_choice(self, index: int, piece: RequestOutput) -> dict[str, Any] | None:
        """One output's chunk choice; None when it carries nothing (a tag held back)."""
        output = self.parsed[index]
        delta = output.feed(piece.text, piece.output_ids)
        reason = None
        if piece.finish is not None:
            delta += output.finish()
            reason = finish_reason(piece.finish, bool(output.calls))
        logprobs = None
        if self.plan.body.logprobs and piece.logprobs:
            logprobs = logprobs_content(self.state, [piece])
        body = _delta_dict(delta)
        if not (body or reason or logprobs):
            return None
        return _choice(index, body, reason, logprobs)

    def _reasoning_counts(self) -> list[int] | None:
        if self.parsed[0].reasoning is None:
            return None
        return [o.reasoning_tokens for o in self.parsed]


def _choice_output(plan: Plan, state: ServerState) -> ChoiceOutput:
    reasoning = None
    if state.args.reasoning_parser and plan.body.separate_reasoning:
        reasoning = ReasoningParser(plan.thinking)
    tools = None
    if state.args.tool_call_parser and plan.tools:
        tools = ToolCallParser(plan.tools)
    # With a parser on, the text keeps special tokens (see _requests) and must be cleaned of them.
    specials = state.args.reasoning_parser is not None or state.args.tool_call_parser is not None
    return ChoiceOutput(
        reasoning, tools, plan.body.parallel_tool_calls, specials, state.reasoning_tag_ids
    )


def _choice(
    index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _delta_dict(delta: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.calls:
        out["tool_calls"] = [_call_delta(c) for c in delta.calls]
    return out


def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
    if call.id is not None:
        out["id"] = call.id
        out["type"] = "function"
    if call.name is not None:
        out["function"]["name"] = call.name
    return out
