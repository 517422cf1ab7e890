"""OpenAI request bodies as msgspec Structs: decoding them is the type check, `/openapi.json` is
generated from them, and fields OpenAI clients may add that we do not know are ignored.
Structs that reach the chat template omit unset fields, so the template sees what was sent;
`to_builtins` turns them into the plain values the template and the tokenizer actor take.

Responses are plain dicts built by the handlers (see `bodies.py`): their shape is OpenAI's,
and clients only read, never validate, them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class Thinking(msgspec.Struct, kw_only=True):
    # Any string decodes; the handler answers 400 for values outside the model's three modes.
    type: str


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the running usage (so a client
    # can count the tokens each chunk held); without include_usage it does nothing, as in vLLM.
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields shared by chat and text completions (OpenAI names, SGLang extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    thinking: Thinking | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; checked by the handler (msgspec unions
    # allow one list type).
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ResponseTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A Responses API tool: a function, flat (no nested `function` object). Any other type
    decodes, so that the handler can refuse it by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    """A Responses input message item; content parts are checked by the handler."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallInput(msgspec.Struct, kw_only=True):
    """A function call the model made in an earlier turn, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(msgspec.Struct, kw_only=True):
    """A function call's result, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. `input` items are dicts here: a message item may come without its
    `type`, which a tagged union cannot decode; `response_input.py` checks each by its kind.
    `thinking` and the SGLang sampling fields after it are the chat endpoint's extensions,
    accepted here too."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    thinking: Thinking | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


REQUEST_TYPES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
}


def to_builtins(value: Any) -> Any:
    """Structs -> plain JSON values (what the chat template and the tokenizer actor take)."""
    return msgspec.to_builtins(value, builtin_types=(bytes,))
