"""response_format and enforced tool_choice over HTTP with a scripted engine: what constraint
reaches the engine, and every refusal a 400 in OpenAI's shape naming the field and feature
before the engine sees the request."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.scripted_engine import ScriptedEngine

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def says(text: str):
    return lambda req: [text]


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}


async def refused(serve, body: dict[str, Any], path: str = CHAT) -> dict[str, Any]:
    async with serve(says("never")) as s:
        response = await s.post(path, body)
        engine: ScriptedEngine = s.engine
        assert engine.seen == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    return error


async def test_json_schema_reaches_the_engine_with_thinking_off(serve) -> None:
    answer = '{"city": "Paris", "days": 2}'
    async with serve(says(answer)) as s:
        body = {"messages": USER, "response_format": json_schema(SCHEMA)}
        response = await s.post(CHAT, {**body, "thinking": {"type": "enabled"}})
        req = s.engine.seen[-1]
    constraint = req.sampling.constraint
    assert constraint.kind == "json_schema"
    assert json.loads(constraint.text) == SCHEMA
    assert req.thinking == "disabled"
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == json.loads(answer)


async def test_json_object_and_text_formats(serve) -> None:
    async with serve(says("{}")) as s:
        await s.post(CHAT, {"messages": USER, "response_format": {"type": "json_object"}})
        await s.post(CHAT, {"messages": USER, "response_format": {"type": "text"}})
        json_req, text_req = s.engine.seen[-2:]
    assert json_req.sampling.constraint.kind == "json_object"
    assert text_req.sampling.constraint is None


async def test_completions_take_a_response_format(serve) -> None:
    async with serve(says("{}")) as s:
        body = {"prompt": "JSON:", "response_format": {"type": "json_object"}}
        response = await s.post("/v1/completions", body)
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert req.sampling.constraint.kind == "json_object"


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "iri"}, "format 'iri'"),
        ({"anyOf": [{"type": "string"}, {"if": {"type": "string"}}]}, "if"),
        ({"type": "strnig"}, "strnig"),
    ],
)
async def test_an_unsupported_schema_feature_is_refused_by_name(
    serve, schema: dict[str, Any], feature: str
) -> None:
    error = await refused(serve, {"messages": USER, "response_format": json_schema(schema)})
    assert error["param"] == "response_format.json_schema"
    assert feature in error["message"]


async def test_a_json_schema_format_without_a_schema_is_refused(serve) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w"}}
    error = await refused(serve, {"messages": USER, "response_format": fmt})
    assert "schema" in error["message"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forcing_tool_choice_without_tools_is_refused(serve, choice: Any) -> None:
    error = await refused(serve, {"messages": USER, "tool_choice": choice})
    assert error["param"] == "tool_choice"


async def test_a_tool_schema_the_grammar_cannot_enforce_is_refused_by_name(serve) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {"properties": {"guests": {"type": "integer", "minimum": 1}}},
        },
    }
    error = await refused(serve, {"messages": USER, "tools": [tool], "tool_choice": "required"})
    assert error["param"] == "tools"
    assert "minimum" in error["message"] and "book" in error["message"]


async def test_a_tool_schema_is_not_checked_when_no_call_is_forced(serve) -> None:
    tool = {"type": "function", "function": {"name": "book", "parameters": {"minProperties": 1}}}
    async with serve(says("ok")) as s:
        response = await s.post(CHAT, {"messages": USER, "tools": [tool]})
    assert response.status_code == 200


async def test_a_forced_call_takes_precedence_over_response_format(serve) -> None:
    """As OpenAI accepts both (agent SDKs send their output type with every turn): the forced
    call is the whole output, so its grammar is the one that reaches the engine."""
    body = {
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    async with serve(says("never")) as s:
        await s.post(CHAT, body)
        req = s.engine.seen[-1]
    assert req.sampling.constraint.kind == "ebnf"
