"""/v1/responses end to end over HTTP with scripted model output: reasoning, message and
function_call items, usage, incomplete output, the typed event stream (every event parsed by
the openai SDK's own types) and its agreement with the non-streamed response, and refusals."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest
from helpers.scripted_engine import ScriptedEngine
from openai.types.responses import Response, ResponseStreamEvent

from m3serve.runtime.messages import Finish, GenerateReq, RequestOutput

N = "]<]minimax[>["
PATH = "/v1/responses"
SIZES = [1, 3, 1000]  # 1 and 3 cut every tag mid-way; 1000 is the whole output in one piece
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
}
THOUGHT_AND_CALL = (
    "<mm:think>\nCheck the weather.\n</mm:think>\n\nLooking it up."
    f'{N}<tool_call>\n{N}<invoke name="get_weather">{N}<location>Beijing{N}</location>'
    f"{N}</invoke>\n{N}</tool_call>"
)
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def says(text: str, size: int = 3):
    return lambda req: [text[i : i + size] for i in range(0, len(text), size)]


class CutOff(ScriptedEngine):
    """A scripted engine whose requests end at their token limit (finish reason length)."""

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        async for output in super().stream(req):
            if output.finish is not None:
                output.finish = Finish("length")
            yield output


def parse_named_sse(body: str) -> list[dict[str, Any]]:
    """A Responses SSE body: `event: <type>` then `data: <json>` per frame, and no [DONE]."""
    assert body.endswith("\n\n"), body[-80:]
    events = []
    for block in body.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        events.append(event)
    return events


async def stream(s, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await s.post(PATH, {**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_named_sse(response.text)


def without_ids(value: Any) -> Any:
    """Item ids, response ids and timestamps differ between two requests; the rest must not."""
    if isinstance(value, dict):
        skip = {"id", "call_id", "created_at", "completed_at"}
        return {k: without_ids(v) for k, v in value.items() if k not in skip}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


# ---------------------------------------------------------------------- the response object


async def test_a_string_input_returns_one_message_and_usage(serve) -> None:
    async with serve(says("Hello there!")) as s:
        response = await s.post(PATH, {"input": "Hi", "instructions": "Be brief."})
        (req,) = s.engine.seen
    assert response.status_code == 200, response.text
    body = response.json()
    parsed = Response.model_validate(body)
    assert parsed.id.startswith("resp_") and parsed.object == "response"
    assert parsed.status == "completed" and body["incomplete_details"] is None
    assert parsed.output_text == "Hello there!"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed"
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens"] == 4  # the scripted engine: one token per piece
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["input_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("size", SIZES)
async def test_reasoning_answer_and_call_become_three_items_in_order(serve, size) -> None:
    request = {"input": "Weather?", "tools": [WEATHER], "reasoning": {"effort": "high"}}
    async with serve(says(THOUGHT_AND_CALL, size)) as s:
        body = (await s.post(PATH, request)).json()
        (req,) = s.engine.seen
    assert (req.thinking, req.reasoning_effort) == ("adaptive", "high")
    Response.model_validate(body)
    reasoning, message, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Check the weather."}]
    assert message["content"][0]["text"] == "Looking it up."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert json.loads(call["arguments"]) == {"location": "Beijing"}
    assert {item["status"] for item in body["output"]} == {"completed"}


async def test_reasoning_tokens_are_those_of_the_trace_and_its_tags(serve) -> None:
    pieces = ["<mm:think>", "I", " think", "</mm:think>", "\n\n", "Hi", "!"]  # a token each
    async with serve(lambda req: pieces) as s:
        body = (await s.post(PATH, {"input": "Hi", "reasoning": {"effort": "low"}})).json()
    assert body["usage"]["output_tokens"] == len(pieces)
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}


async def test_reasoning_effort_none_turns_thinking_off(serve) -> None:
    async with serve(says("Hi")) as s:
        await s.post(PATH, {"input": "Hi", "reasoning": {"effort": "none"}})
        (req,) = s.engine.seen
    assert (req.thinking, req.reasoning_effort) == ("disabled", None)


async def test_a_function_call_output_reaches_the_template_as_a_tool_message(serve) -> None:
    turn = [
        {"role": "user", "content": "Weather in Beijing?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"location": "Beijing"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 25C"},
    ]  # fmt: skip
    async with serve(says("It is sunny.")) as s:
        body = (await s.post(PATH, {"input": turn, "tools": [WEATHER]})).json()
        (req,) = s.engine.seen
    assert [m["role"] for m in req.messages] == ["user", "assistant", "tool"]
    assert req.messages[1]["tool_calls"][0]["id"] == "call_1"
    assert req.messages[2] == {"role": "tool", "content": "sunny, 25C", "tool_call_id": "call_1"}
    assert req.tools and req.tools[0]["function"]["name"] == "get_weather"
    assert Response.model_validate(body).output_text == "It is sunny."


async def test_output_cut_by_the_token_limit_is_incomplete(serve, model_dir) -> None:
    async with serve(CutOff(says("Still writ"), str(model_dir))) as s:
        body = (await s.post(PATH, {"input": "Hi", "max_output_tokens": 4})).json()
        events = await stream(s, {"input": "Hi", "max_output_tokens": 4})
        (req, _) = s.engine.seen
    assert req.sampling.max_new_tokens == 4
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][-1]["status"] == "incomplete"
    assert "completed_at" not in body
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"


async def test_an_empty_output_is_one_empty_message(serve) -> None:
    async with serve(says("")) as s:
        body = (await s.post(PATH, {"input": "Hi"})).json()
        events = await stream(s, {"input": "Hi"})
    (item,) = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    assert [e["type"] for e in events].count("response.output_item.done") == 1


# ---------------------------------------------------------------------- streaming


@pytest.mark.parametrize("size", SIZES)
async def test_every_stream_event_parses_as_the_sdk_types_it(serve, size) -> None:
    request = {"input": "Weather?", "tools": [WEATHER]}
    async with serve(says(THOUGHT_AND_CALL, size)) as s:
        events = await stream(s, request)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.completed"
    assert not any(e["type"] == "response.completed" for e in events[:-1])


@pytest.mark.parametrize("size", SIZES)
async def test_the_stream_reassembles_into_the_non_streamed_response(serve, size) -> None:
    request = {"input": "Weather?", "tools": [WEATHER]}
    async with serve(says(THOUGHT_AND_CALL, size)) as s:
        whole = (await s.post(PATH, request)).json()
        events = await stream(s, request)
    final = events[-1]["response"]
    assert without_ids(final) == without_ids(whole)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(final["output"])))
    reasoning, message, call = final["output"]
    assert deltas(events, "response.reasoning_text.delta") == reasoning["content"][0]["text"]
    assert deltas(events, "response.output_text.delta") == message["content"][0]["text"]
    assert deltas(events, "response.function_call_arguments.delta") == call["arguments"]
    (arguments_done,) = [e for e in events if e["type"].endswith("function_call_arguments.done")]
    assert arguments_done["arguments"] == call["arguments"]
    assert arguments_done["item_id"] == call["id"]


def deltas(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind)


async def test_each_item_opens_before_its_deltas_and_closes_after_them(serve) -> None:
    async with serve(says(THOUGHT_AND_CALL, 2)) as s:
        events = await stream(s, {"input": "Weather?", "tools": [WEATHER]})
    by_item: dict[int, list[str]] = {}
    for event in events[2:-1]:
        by_item.setdefault(event["output_index"], []).append(event["type"].split(".", 1)[1])
    for kinds in by_item.values():
        assert kinds[0] == "output_item.added" and kinds[-1] == "output_item.done"
    assert by_item[1][1] == "content_part.added"
    assert by_item[1][-3:] == ["output_text.done", "content_part.done", "output_item.done"]
    # Items never interleave: each one is done before the next is added.
    order = [e["output_index"] for e in events[2:-1]]
    assert order == sorted(order)


# ---------------------------------------------------------------------- refusals and listing


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "Hi", "reasoning": {"effort": "enormous"}}, "reasoning.effort"),
        ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
         "tool_choice"),
        ({"input": "Hi", "temperature": 3}, "temperature"),
        ({"input": 5}, "input"),
    ],
)  # fmt: skip
async def test_refusals_are_openai_errors_before_anything_runs(serve, body, param) -> None:
    async with serve(says("never")) as s:
        response = await s.post(PATH, {**body, "stream": True})
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_openapi_lists_the_responses_endpoint(serve) -> None:
    async with serve(says("")) as s:
        doc = (await s.client.get("/openapi.json")).json()
    schema = doc["paths"][PATH]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[1]
    assert "input" in doc["components"]["schemas"][name]["properties"]
