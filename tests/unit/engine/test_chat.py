"""`AsyncEngine.chat`'s request and result without an engine: thinking resolved as the API
resolves it, the parsers' tags kept in the text, and the output split into content, reasoning
and OpenAI-shaped tool calls by the server's own parsers."""

from __future__ import annotations

import json

import pytest

from m3serve.engine.chat import chat_request, parsed
from m3serve.engine.errors import RequestError
from m3serve.model.special_tokens import TOOL_NAMESPACE as N

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
    },
}
CALL = (
    f'{N}<tool_call>\n{N}<invoke name="get_weather">{N}<days>3{N}</days>{N}</invoke>\n'
    f"{N}</tool_call>"
)


def request(tools=None, **fields):
    values = {"thinking": None, "reasoning_effort": None, "chat_template_kwargs": None}
    return chat_request(USER, tools, {"max_new_tokens": 8}, **{**values, **fields}, rid=None)


def test_sampling_keeps_the_special_tokens_the_parsers_read() -> None:
    req = request()
    assert req.sampling.max_new_tokens == 8
    assert req.sampling.skip_special_tokens is False
    assert (req.thinking, req.reasoning_effort) == ("adaptive", None)


def test_thinking_resolves_as_the_api_resolves_it() -> None:
    assert (request(reasoning_effort="none").thinking, request(thinking="enabled").thinking) == (
        "disabled",
        "enabled",
    )
    with pytest.raises(RequestError, match="thinking must be one of"):
        request(thinking="sometimes")


def test_the_output_splits_into_reasoning_content_and_typed_tool_calls() -> None:
    req = request([WEATHER], thinking="enabled")
    result = parsed({"text": "Look it up.</mm:think>\n\nChecking." + CALL, "meta_info": {}}, req)
    assert result["reasoning_content"] == "Look it up."
    assert result["content"] == "Checking."
    (call,) = result["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"days": 3}  # typed by the schema
    assert result["meta_info"] == {}


def test_without_tools_a_call_block_stays_text_and_no_reasoning_is_none() -> None:
    result = parsed({"text": "Hello" + CALL}, request(thinking="disabled"))
    assert result["reasoning_content"] is None
    assert result["tool_calls"] == []
    assert result["content"] == "Hello" + CALL
