"""`/v1/responses` through the official `openai` SDK and the openai-agents SDK, against a live
`m3serve serve` (multi-process engine, both MiniMax parsers, API key) on the tiny random model.

The tiny model writes gibberish, so these tests pin down types, event order, usage arithmetic,
stream/non-stream agreement at temperature 0 and the tool round trip — never meaning.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from helpers.sdk_server import API_KEY, Server, sdk_fixtures
from openai.types.responses import Response, ResponseStreamEvent

SMALL = 12
GREEDY = {"temperature": 0, "max_output_tokens": SMALL}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        # Bounded, so that the random model's forced call ends within the token budget.
        "properties": {"location": {"type": "string", "maxLength": 12}},
        "required": ["location"],
    },
}
QUESTION = {"role": "user", "content": "What's the weather in Beijing?"}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


server, client, http = sdk_fixtures("module")


def create(client: openai.OpenAI, server: Server, **kwargs: Any) -> Any:
    return client.responses.create(model=server.model, **{"input": "Hello!", **GREEDY, **kwargs})


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        skip = {"id", "call_id", "created_at", "completed_at"}
        return {k: without_ids(v) for k, v in value.items() if k not in skip}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def test_create_returns_a_typed_response_with_consistent_usage(
    client: openai.OpenAI, server: Server
) -> None:
    response = create(client, server, instructions="Answer briefly.")
    assert isinstance(response, Response)
    assert response.id.startswith("resp_") and response.model == server.model
    assert response.status in ("completed", "incomplete")
    assert isinstance(response.output_text, str)
    assert [item.type for item in response.output] == ["message"]
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0
    assert 1 <= usage.output_tokens <= SMALL
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == SMALL


def test_reasoning_enabled_returns_a_reasoning_item_first(
    client: openai.OpenAI, server: Server
) -> None:
    response = create(client, server, extra_body={"thinking": {"type": "enabled"}})
    first = response.output[0]
    assert first.type == "reasoning"
    assert first.content and first.content[0].type == "reasoning_text"
    assert isinstance(first.content[0].text, str)
    details = response.usage.output_tokens_details
    assert 1 <= details.reasoning_tokens <= response.usage.output_tokens


@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
def test_the_typed_event_stream_reassembles_into_the_response(
    client: openai.OpenAI, server: Server, thinking: str
) -> None:
    extra = {"extra_body": {"thinking": {"type": thinking}}}
    create(client, server, **extra)  # warm the prefix cache: cached_tokens match below
    whole = create(client, server, **extra)
    events = list(create(client, server, stream=True, **extra))
    for event in events:  # the SDK parsed each leniently; its strict types must accept them too
        EVENTS.validate_python(event.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type == f"response.{whole.status}"
    assert without_ids(final.response.model_dump()) == without_ids(whole.model_dump())
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "".join(
        part.text for item in whole.output if item.type == "reasoning" for part in item.content
    )


def test_a_function_call_round_trips_into_the_next_turn(
    client: openai.OpenAI, server: Server, http: httpx.Client
) -> None:
    first = create(
        client,
        server,
        input=[QUESTION],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments), dict)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25C"}
    second = create(client, server, input=[QUESTION, call.model_dump(), result])
    assert second.status in ("completed", "incomplete")
    # The next turn's prompt is the chat template over the same conversation as chat messages.
    messages = [
        QUESTION,
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 25C"},
    ]  # fmt: skip
    tokens = http.post("/v1/tokenize", json={"messages": messages}).json()
    assert second.usage.input_tokens == tokens["count"]


def test_stateful_requests_are_refused(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, server, previous_response_id="resp_123")
    assert "stateful responses are not supported" in caught.value.message


# ---------------------------------------------------------------------- openai-agents


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_agent_completes_a_tool_loop_on_the_default_responses_model(
    server: Server, streamed: bool
) -> None:
    """An openai-agents Agent with one function tool and a structured output type, on its
    default OpenAIResponsesModel, against the random model: turn 1 runs under
    `tool_choice="required"` (the server's grammar forces a valid call), the SDK runs the tool
    and sends its output back with tool_choice reset to auto, and turn 2 is constrained by the
    output type's JSON schema (text.format), so it ends by itself as a parseable answer.
    Asserted: the tool ran once, the run's items are call -> output -> message, and the final
    output is an instance of the output type."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    agents.set_default_openai_client(sdk, use_for_tracing=False)
    ran: list[str] = []

    class Report(pydantic.BaseModel):
        summary: str = pydantic.Field(max_length=16)

    @agents.function_tool
    def get_weather() -> str:
        """Get the current weather."""
        ran.append("get_weather")
        return "sunny, 25C"

    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=256)
    # The server serves one model whatever the name; a path as the name would read as a prefix.
    agent = agents.Agent(
        name="weather",
        instructions="Use your tools.",
        tools=[get_weather],
        model="m3serve-tiny",
        model_settings=settings,
        output_type=Report,
    )
    question = "What's the weather in Beijing?"
    if streamed:
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
    else:
        result = await agents.Runner.run(agent, question, max_turns=4)
    await sdk.close()
    assert ran == ["get_weather"]
    items = [type(item).__name__ for item in result.new_items]
    assert items == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, Report)
