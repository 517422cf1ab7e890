"""A Responses API request as the chat request it means, so that the chat path validates,
renders and runs it: `instructions` and the `input` items become chat messages, function tools
become chat tools, and the sampling and thinking fields carry over.

The server keeps no state between requests. `store` is accepted (clients send true by default)
and stores nothing; `previous_response_id`, `conversation` and `item_reference` items would
need stored responses, so they are refused. Reasoning items sent back as input are dropped: the
chat template never shows the model its past reasoning either.
"""

from __future__ import annotations

from typing import Any

import msgspec

from m3serve.api.errors import APIError
from m3serve.api.protocol import (
    ChatCompletionRequest,
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionDef,
    InputMessage,
    JsonSchemaFormat,
    Message,
    NamedToolChoice,
    ResponseFormat,
    ResponsesRequest,
    ResponseTool,
    ResponseToolChoice,
    Tool,
    ToolCallIn,
    ToolChoiceFunction,
)
from m3serve.api.protocol import FunctionCall as CallBody

TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
MEDIA_PARTS = ("input_file", "input_audio")
STATEFUL = "stateful responses are not supported: this server stores nothing; send the whole "
STATEFUL += "conversation as input items"


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means; every refusal names the Responses field."""
    _check_stateless(body)
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, "max_output_tokens must be >= 1", "max_output_tokens")
    return ChatCompletionRequest(
        model=body.model,
        messages=messages(body.input, body.instructions),
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        response_format=_response_format(body.text),
        parallel_tool_calls=body.parallel_tool_calls,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        thinking=body.thinking,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        stream=body.stream,
        user=body.user,
    )


def messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[Message]:
    """Chat messages from the input: consecutive function calls (and the assistant message
    right before them) make one assistant turn, each call's output a `tool` message."""
    out = [Message(role="system", content=instructions)] if instructions else []
    if isinstance(items, str):
        return [*out, Message(role="user", content=items)]
    if not items:
        raise APIError(400, "input must not be empty", "input")
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input.{i}"
        if kind == "message":
            message = _convert(item, InputMessage, param)
            out.append(Message(role=message.role, content=_content(message.content, param)))
        elif kind == "function_call":
            _add_call(out, _convert(item, FunctionCallInput, param))
        elif kind == "function_call_output":
            result = _convert(item, FunctionCallOutputInput, param)
            content = _content(result.output, param)
            out.append(Message(role="tool", content=content, tool_call_id=result.call_id))
        elif kind == "item_reference":
            raise APIError(400, STATEFUL, param)
        elif kind != "reasoning":
            raise APIError(400, f"input item type {kind!r} is not supported", param)
    return out


def _add_call(out: list[Message], call: FunctionCallInput) -> None:
    wire = ToolCallIn(id=call.call_id, function=CallBody(name=call.name, arguments=call.arguments))
    last = out[-1] if out else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), wire]
    else:
        out.append(Message(role="assistant", tool_calls=[wire]))


def _content(content: str | list[dict[str, Any]], param: str) -> str | list[dict[str, Any]]:
    """Text of a string or of text parts (the template takes either, a string is simplest);
    with images, chat content parts: text parts and `image_url` parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind == "input_image":
            parts.append(_image_part(part, param))
            continue
        if kind in MEDIA_PARTS:
            raise APIError(400, f"{kind} input is not supported", param)
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"unsupported content part {kind!r}", param)
        parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    # Responses' input_image carries the URL itself (`image_url`: a data: or http(s) URL);
    # uploaded files (`file_id`) would need a file store.
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise APIError(400, "an input_image part needs image_url (a URL string)", param)
    return {"type": "image_url", "image_url": {"url": url}}


def _tools(tools: list[ResponseTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            message = f"tool type {tool.type!r} is not supported: only function tools"
            raise APIError(400, message, f"tools.{i}.type")
        if not tool.name:
            raise APIError(400, "a function tool needs a name", f"tools.{i}.name")
        function = FunctionDef(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(Tool(function=function))
    return out


def _tool_choice(choice: str | ResponseToolChoice | None) -> Any:
    if not isinstance(choice, ResponseToolChoice):
        return choice
    if choice.type != "function" or not choice.name:
        raise APIError(400, f"tool_choice of type {choice.type!r} is not supported", "tool_choice")
    return NamedToolChoice(function=ToolChoiceFunction(name=choice.name))


def _check_stateless(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(400, STATEFUL, "previous_response_id")
    if body.conversation is not None:
        raise APIError(400, STATEFUL, "conversation")


def _response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    """Chat's `response_format` for `text.format`, whose json_schema fields are flat."""
    fmt = (text or {}).get("format") or {}
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "text.format json_schema needs a schema object", "text.format")
        name = fmt.get("name") if isinstance(fmt.get("name"), str) else "response"
        strict = fmt.get("strict") if isinstance(fmt.get("strict"), bool) else None
        spec = JsonSchemaFormat(name=name, schema_=schema, strict=strict)
        return ResponseFormat(type="json_schema", json_schema=spec)
    raise APIError(400, f"text.format {kind!r} is not supported", "text.format")


def _convert(item: dict[str, Any], kind: type[msgspec.Struct], param: str) -> Any:
    try:
        return msgspec.convert(item, kind)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid input item: {exc}", param) from exc
