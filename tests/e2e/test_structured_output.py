"""Structured output and enforced tool_choice through the openai SDK against a live
`m3serve serve` on the tiny random checkpoint, with the overlap scheduler on and off.

Random weights write gibberish, so every valid JSON document and schema-valid tool call here is
the grammar's doing. Requests sample (seeded) rather than decode greedily: a greedy random model
can repeat one allowed token (a digit, say) until max_tokens; sampling reaches the grammar's end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers.sdk_server import API_KEY, Server, start_server
from pydantic import BaseModel, Field

BUDGET = {"max_tokens": 400, "temperature": 1.0, "seed": 7}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
FORECAST_TOOL = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["rain", "sun"]}, "maxItems": 2},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


class Forecast(BaseModel):
    city: str = Field(pattern=r"^[A-Z][a-z]{1,8}$")
    days: int
    sunny: bool


@pytest.fixture(scope="module", params=["overlap", "no-overlap"])
def server(
    request: pytest.FixtureRequest, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    extra = ["--disable-overlap-schedule"] if request.param == "no-overlap" else []
    log = tmp_path_factory.mktemp("serve") / "server.log"
    running = start_server(model_path, log, extra)
    yield running
    assert running.stop() == []


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as sdk:
        yield sdk


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]


def create(client: openai.OpenAI, server: Server, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=server.model, **{"messages": ASK, **kwargs})


def test_parse_with_a_pydantic_model_returns_the_parsed_object(
    client: openai.OpenAI, server: Server
) -> None:
    completion = client.chat.completions.parse(
        model=server.model, messages=ASK, response_format=Forecast, **BUDGET
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == parsed


def test_json_object_returns_a_json_object(client: openai.OpenAI, server: Server) -> None:
    response = create(client, server, response_format={"type": "json_object"}, **BUDGET)
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_a_streamed_json_schema_reassembles_into_valid_json(
    client: openai.OpenAI, server: Server
) -> None:
    schema = Forecast.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}
    chunks = list(create(client, server, response_format=fmt, stream=True, **BUDGET))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_tool_choice_required_returns_a_schema_valid_call(
    client: openai.OpenAI, server: Server
) -> None:
    response = create(
        client, server, tools=[FORECAST_TOOL, CLOCK_TOOL], tool_choice="required", **BUDGET
    )
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls
    schemas = {t["function"]["name"]: parameters(t) for t in (FORECAST_TOOL, CLOCK_TOOL)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_tool_choice_returns_that_tool_streamed_as_whole(
    client: openai.OpenAI, server: Server
) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    request = {"tools": [CLOCK_TOOL, FORECAST_TOOL], "tool_choice": named, **BUDGET}
    (call,) = create(client, server, **request).choices[0].message.tool_calls
    assert call.function.name == "get_forecast"
    jsonschema.validate(json.loads(call.function.arguments), parameters(FORECAST_TOOL))
    deltas = [
        d for chunk in create(client, server, stream=True, **request) if chunk.choices
        for d in chunk.choices[0].delta.tool_calls or []
    ]  # fmt: skip
    assert deltas[0].function.name == "get_forecast"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_an_unsupported_schema_feature_is_a_bad_request_naming_it(
    client: openai.OpenAI, server: Server
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, server, response_format=fmt, max_tokens=8)
    assert "uniqueItems" in caught.value.body["message"]
