"""/v1/chat/completions over HTTP with scripted model output: MiniMax tool-call XML parsed into
OpenAI tool_calls (streamed and not, however the text is cut into pieces), and tool_choice.
"""

from __future__ import annotations

import json

import pytest
from helpers.scripted_engine import ScriptedEngine

from .chat_scripts import (
    CHAT,
    SIZES,
    TIME,
    TWO_CALLS,
    WEATHER,
    WEATHER_ARGS,
    WEATHER_CALL,
    N,
    call_deltas,
    chat,
    finishes,
    positions,
    says,
    streamed,
)

# ---------------------------------------------------------------------- tool calls


@pytest.mark.parametrize("size", SIZES)
async def test_a_tool_call_block_becomes_tool_calls(serve, size) -> None:
    async with serve(says("Let me check.\n" + WEATHER_CALL, size)) as s:
        response = await s.post(CHAT, chat(tools=[WEATHER]))
    assert response.status_code == 200
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == WEATHER_ARGS


@pytest.mark.parametrize("size", SIZES)
async def test_a_streamed_tool_call_opens_with_id_and_name_then_streams_arguments(
    serve, size
) -> None:
    async with serve(says("Let me check.\n" + WEATHER_CALL, size)) as s:
        whole = (await s.post(CHAT, chat(tools=[WEATHER]))).json()
        events = await s.events(CHAT, chat(tools=[WEATHER]))
    deltas = call_deltas(events)
    first, rest = deltas[0], deltas[1:]
    assert first["index"] == 0
    assert first["id"].startswith("call_")
    assert first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all("id" not in d and "name" not in d["function"] for d in rest)
    assert {d["index"] for d in deltas} == {0}
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert arguments == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == WEATHER_ARGS
    # The answer before the block streams as content, none of the block does.
    assert streamed(events, "content") == "Let me check.\n"
    first_call = min(positions(events, "tool_calls"))
    assert max(positions(events, "content")) <= first_call
    assert finishes(events) == ["tool_calls"]


@pytest.mark.parametrize("size", [1, 3, 1000])
async def test_two_invokes_in_one_block_are_two_tool_calls(serve, size) -> None:
    async with serve(says(TWO_CALLS, size)) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER, TIME]))).json()
        events = await s.events(CHAT, chat(tools=[WEATHER, TIME]))
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"location": "Beijing"},
        {"city": "Paris"},
    ]
    assert calls[0]["id"] != calls[1]["id"]
    deltas = call_deltas(events)
    assert sorted({d["index"] for d in deltas}) == [0, 1]
    for index, name, args in (
        (0, "get_weather", {"location": "Beijing"}),
        (1, "get_time", {"city": "Paris"}),
    ):
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0]["function"]["name"] == name
        assert mine[0]["id"].startswith("call_")
        assert json.loads("".join(d["function"]["arguments"] for d in mine)) == args
    assert finishes(events) == ["tool_calls"]


async def test_parallel_tool_calls_false_keeps_only_the_first_call(serve) -> None:
    async with serve(says(TWO_CALLS, 4)) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER, TIME], parallel_tool_calls=False))).json()
        events = await s.events(CHAT, chat(tools=[WEATHER, TIME], parallel_tool_calls=False))
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert {d["index"] for d in call_deltas(events)} == {0}
    assert finishes(events) == ["tool_calls"]


async def test_a_call_to_a_tool_not_offered_is_dropped(serve) -> None:
    async with serve(says(TWO_CALLS, 3)) as s:
        body = (await s.post(CHAT, chat(tools=[TIME]))).json()
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"


async def test_tool_arguments_are_typed_by_the_tool_schema(serve) -> None:
    booking = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "guests": {"type": "integer"},
                    "vegan": {"type": "boolean"},
                    "budget": {"type": "number"},
                    "dates": {"type": "array", "items": {"type": "string"}},
                    "room": {
                        "type": "object",
                        "properties": {"floor": {"type": "integer"}, "view": {"type": "string"}},
                    },
                    "zip": {"type": "string"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
    output = (
        f'{N}<tool_call>\n{N}<invoke name="book">'
        f"{N}<guests>3{N}</guests>{N}<vegan>true{N}</vegan>{N}<budget>99.5{N}</budget>"
        f"{N}<dates>{N}<item>2025-01-01{N}</item>{N}<item>2025-01-02{N}</item>{N}</dates>"
        f"{N}<room>{N}<floor>2{N}</floor>{N}<view>sea <b>&</b>{N}</view>{N}</room>"
        f"{N}<zip>02139{N}</zip>{N}<note>null{N}</note>"
        f"{N}</invoke>\n{N}</tool_call>"
    )
    async with serve(says(output, 2)) as s:
        body = (await s.post(CHAT, chat(tools=[booking]))).json()
        events = await s.events(CHAT, chat(tools=[booking]))
    expected = {
        "guests": 3,
        "vegan": True,
        "budget": 99.5,
        "dates": ["2025-01-01", "2025-01-02"],
        "room": {"floor": 2, "view": "sea <b>&</b>"},
        "zip": "02139",
        "note": None,
    }
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == expected
    streamed_args = "".join(d["function"]["arguments"] for d in call_deltas(events))
    assert json.loads(streamed_args) == expected


@pytest.mark.parametrize("size", [1, 3, 1000])
async def test_an_invoke_cut_off_by_max_tokens_is_not_a_tool_call(serve, model_dir, size) -> None:
    cut = TWO_CALLS[: TWO_CALLS.index("Paris")]
    engine = ScriptedEngine(says("Checking." + cut, size), str(model_dir), finish="length")
    async with serve(engine) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER, TIME]))).json()
        events = await s.events(CHAT, chat(tools=[WEATHER, TIME]))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"location": "Beijing"}
    # Streamed: the cut call's id and name went out as it opened, with no arguments after them.
    assert finishes(events) == ["length"]
    assert streamed(events, "content") == "Checking."
    cut_deltas = [d for d in call_deltas(events) if d["index"] == 1]
    assert [d["function"].get("name") for d in cut_deltas] == ["get_time"]
    assert "".join(d["function"]["arguments"] for d in cut_deltas) == ""


async def test_special_tokens_never_reach_content(serve) -> None:
    text = f"]~b]Hello{N} there[e~[.]<]image[>["
    async with serve(says(text, 2)) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER]))).json()
        events = await s.events(CHAT, chat(tools=[WEATHER]))
    assert body["choices"][0]["message"]["content"] == "Hello there."
    assert streamed(events, "content") == "Hello there."


# ---------------------------------------------------------------------- tool_choice

PARIS_CALL = (
    f'{N}<tool_call>\n{N}<invoke name="get_weather">{N}<location>Paris{N}</location>'
    f"{N}</invoke>\n{N}</tool_call>"
)


async def test_tool_choice_required_constrains_the_answer_to_a_tool_call(serve) -> None:
    async with serve(says(PARIS_CALL, 3)) as s:
        response = await s.post(
            CHAT, chat(tools=[WEATHER], tool_choice="required", reasoning_effort="high")
        )
        req = s.engine.seen[-1]
    assert req.assistant_prefix is None
    constraint = req.sampling.constraint
    assert constraint is not None and constraint.kind == "ebnf"
    assert 'invoke name=\\"get_weather\\"' in constraint.text
    assert (req.thinking, req.reasoning_effort) == ("disabled", None)
    (choice,) = response.json()["choices"]
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


async def test_a_named_tool_choice_constrains_the_answer_to_that_tool(serve) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with serve(says(PARIS_CALL, 3)) as s:
        response = await s.post(CHAT, chat(tools=[TIME, WEATHER], tool_choice=named))
        req = s.engine.seen[-1]
    assert req.thinking == "disabled"
    grammar = req.sampling.constraint.text
    assert "get_weather" in grammar and "get_time" not in grammar
    (choice,) = response.json()["choices"]
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


async def test_a_streamed_named_tool_choice_sends_the_call_id_and_name(serve) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with serve(says(PARIS_CALL, 3)) as s:
        events = await s.events(CHAT, chat(tools=[WEATHER], tool_choice=named))
    deltas = call_deltas(events)
    assert deltas, "no tool_calls delta streamed"
    assert deltas[0]["function"].get("name") == "get_weather"
    assert deltas[0].get("id", "").startswith("call_")
    assert deltas[0].get("type") == "function"
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == {"location": "Paris"}
    assert streamed(events, "content") == ""
    assert finishes(events) == ["tool_calls"]


async def test_a_named_tool_choice_outside_tools_is_refused(serve) -> None:
    named = {"type": "function", "function": {"name": "launch_rockets"}}
    async with serve(says("never")) as s:
        response = await s.post(CHAT, chat(tools=[WEATHER], tool_choice=named))
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice"
    assert "launch_rockets" in error["message"]


async def test_tool_choice_none_sends_no_tools_and_parses_no_calls(serve) -> None:
    async with serve(says(WEATHER_CALL, 3)) as s:
        response = await s.post(CHAT, chat(tools=[WEATHER], tool_choice="none"))
        req = s.engine.seen[-1]
    assert req.tools is None
    assert req.sampling.constraint is None
    (choice,) = response.json()["choices"]
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


async def test_tool_choice_auto_sends_the_tools_to_the_template(serve) -> None:
    async with serve(says("Sunny.")) as s:
        await s.post(CHAT, chat(tools=[WEATHER], tool_choice="auto"))
        req = s.engine.seen[-1]
    assert req.sampling.constraint is None
    assert [t["function"]["name"] for t in req.tools] == ["get_weather"]
    assert req.tools[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
