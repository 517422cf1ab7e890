"""/v1/chat/completions end to end over HTTP with scripted model output: reasoning and tool calls
parsed out of the text (streamed and not, however the text is cut into pieces), tool_choice,
thinking controls, n choices, servers without parsers, and client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from helpers.scripted_engine import ScriptedEngine

from m3serve.runtime.config import ApiArgs
from m3serve.runtime.messages import GenerateReq

N = "]<]minimax[>["
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is 6 times 6? And the weather in Beijing?"}]
# Piece sizes: 1 and 3 cut every tag mid-way; 1000 is the whole output in one piece.
SIZES = [1, 2, 3, 5, 13, 1000]

THOUGHT = "I think\n</mm:think>\n\nThe answer is 36."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# §F.3's example: the answer text, then one block with one invoke.
WEATHER_CALL = (
    f"{N}<tool_call>\n"
    f'{N}<invoke name="get_weather">{N}<location>Beijing{N}</location>'
    f"{N}<unit>celsius{N}</unit>{N}</invoke>\n"
    f"{N}</tool_call>"
)
WEATHER_ARGS = {"location": "Beijing", "unit": "celsius"}
TWO_CALLS = (
    f"{N}<tool_call>\n"
    f'{N}<invoke name="get_weather">{N}<location>Beijing{N}</location>{N}</invoke>\n'
    f'{N}<invoke name="get_time">{N}<city>Paris{N}</city>{N}</invoke>\n'
    f"{N}</tool_call>"
)


def chop(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def says(text: str, size: int = 3):
    """A script answering every request with `text` in pieces of `size` characters."""
    return lambda req: chop(text, size)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, **fields}


def streamed(events: list[dict], key: str, index: int = 0) -> str:
    """The concatenated `delta[key]` of one choice."""
    return "".join(
        c["delta"].get(key) or "" for e in events for c in e["choices"] if c["index"] == index
    )


def call_deltas(events: list[dict], index: int = 0) -> list[dict]:
    return [
        call
        for e in events
        for c in e["choices"]
        if c["index"] == index
        for call in c["delta"].get("tool_calls", [])
    ]


def finishes(events: list[dict], index: int = 0) -> list[str]:
    return [
        c["finish_reason"]
        for e in events
        for c in e["choices"]
        if c["index"] == index and c["finish_reason"] is not None
    ]


def positions(events: list[dict], key: str) -> list[int]:
    return [i for i, e in enumerate(events) for c in e["choices"] if c["delta"].get(key)]


# ---------------------------------------------------------------------- reasoning


@pytest.mark.parametrize("size", SIZES)
async def test_enabled_thinking_puts_the_trace_in_reasoning_content(serve, size) -> None:
    async with serve(says(THOUGHT, size)) as s:
        response = await s.post(CHAT, chat(thinking={"type": "enabled"}))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "reasoning_content": "I think",
        "content": "The answer is 36.",
    }
    assert choice["finish_reason"] == "stop"
    assert isinstance(body["usage"]["completion_tokens_details"]["reasoning_tokens"], int)


@pytest.mark.parametrize("size", SIZES)
async def test_enabled_thinking_streams_reasoning_deltas_then_content_deltas(serve, size) -> None:
    async with serve(says(THOUGHT, size)) as s:
        whole = (await s.post(CHAT, chat(thinking={"type": "enabled"}))).json()
        events = await s.events(
            CHAT, chat(thinking={"type": "enabled"}, stream_options={"include_usage": True})
        )
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    message = whole["choices"][0]["message"]
    assert streamed(events, "reasoning_content") == message["reasoning_content"] == "I think"
    assert streamed(events, "content") == message["content"] == "The answer is 36."
    assert max(positions(events, "reasoning_content")) <= min(positions(events, "content"))
    assert finishes(events) == ["stop"]
    usage = events[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 1
    assert usage["usage"] == whole["usage"]


async def test_reasoning_tokens_count_up_to_and_including_the_closing_tag(serve) -> None:
    # One token per piece, as the engine streams them.
    pieces = ["I", " think", "\n", "</mm:think>", "\n\n", "The", " answer", " is", " 36."]
    async with serve(lambda req: pieces) as s:
        body = (await s.post(CHAT, chat(thinking={"type": "enabled"}))).json()
        events = await s.events(
            CHAT, chat(thinking={"type": "enabled"}, stream_options={"include_usage": True})
        )
    expected = {
        "prompt_tokens": 10,
        "completion_tokens": len(pieces),
        "total_tokens": 10 + len(pieces),
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    assert body["usage"] == expected
    assert events[-1]["usage"] == expected


@pytest.mark.parametrize("size", SIZES)
async def test_adaptive_output_that_opens_its_own_think_tag_is_reasoning(serve, size) -> None:
    text = "<mm:think>\nLet me see.\n</mm:think>\n\nHello!"
    async with serve(says(text, size)) as s:
        body = (await s.post(CHAT, chat())).json()
        events = await s.events(CHAT, chat())
        assert s.engine.seen[-1].thinking == "adaptive"
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Hello!")
    assert streamed(events, "reasoning_content") == "Let me see."
    assert streamed(events, "content") == "Hello!"


async def test_adaptive_output_without_a_think_tag_is_all_content(serve) -> None:
    async with serve(says("  Just an answer.", 2)) as s:
        body = (await s.post(CHAT, chat())).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "  Just an answer."
    assert message["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("size", SIZES)
async def test_disabled_thinking_drops_a_stray_leading_closing_tag(serve, size) -> None:
    # A think tag inside the answer is answer text, but as a special token it is removed.
    async with serve(says("</mm:think>\n\nHello, <mm:think> is a tag.", size)) as s:
        body = (await s.post(CHAT, chat(thinking={"type": "disabled"}))).json()
        events = await s.events(CHAT, chat(thinking={"type": "disabled"}))
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello,  is a tag."
    assert message["reasoning_content"] is None
    assert streamed(events, "content") == "Hello,  is a tag."
    assert positions(events, "reasoning_content") == []


async def test_reasoning_cut_off_by_max_tokens_stays_reasoning(serve) -> None:
    async with serve(says("Still thinking about", 4)) as s:
        body = (await s.post(CHAT, chat(thinking={"type": "enabled"}))).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Still thinking about"
    assert message["content"] == ""


async def test_separate_reasoning_false_keeps_the_trace_in_content(serve) -> None:
    async with serve(says(THOUGHT)) as s:
        body = await s.post(CHAT, chat(thinking={"type": "enabled"}, separate_reasoning=False))
    message = body.json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"] == THOUGHT


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


# ---------------------------------------------------------------------- thinking controls


@pytest.mark.parametrize(
    ("fields", "thinking", "effort"),
    [
        ({}, "adaptive", None),
        ({"thinking": {"type": "enabled"}}, "enabled", None),
        ({"thinking": {"type": "disabled"}}, "disabled", None),
        ({"reasoning_effort": "high"}, "adaptive", "high"),
        ({"thinking": {"type": "enabled"}, "reasoning_effort": "max"}, "enabled", "max"),
        ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, "disabled", None),
        ({"reasoning_effort": "none"}, "disabled", None),
        ({"thinking": {"type": "enabled"}, "reasoning_effort": "minimal"}, "disabled", None),
        ({"chat_template_kwargs": {"thinking_mode": "enabled"}}, "enabled", None),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "adaptive", "low"),
        (
            {
                "thinking": {"type": "disabled"},
                "chat_template_kwargs": {"thinking_mode": "enabled"},
            },
            "disabled",
            None,
        ),
    ],
)
async def test_thinking_controls_reach_the_engine_request(serve, fields, thinking, effort):
    async with serve(says("ok")) as s:
        response = await s.post(CHAT, chat(**fields))
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert (req.thinking, req.reasoning_effort) == (thinking, effort)
    assert req.chat_template_kwargs is None  # the thinking keys are taken out


async def test_other_chat_template_kwargs_pass_through(serve) -> None:
    kwargs = {"thinking_mode": "enabled", "reasoning_effort": "low", "custom_flag": [1, 2]}
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat(chat_template_kwargs=kwargs))
        req = s.engine.seen[-1]
    assert req.chat_template_kwargs == {"custom_flag": [1, 2]}
    assert (req.thinking, req.reasoning_effort) == ("enabled", "low")


@pytest.mark.parametrize(
    "fields",
    [
        {"thinking": {"type": "on"}},
        {"thinking": "enabled"},
        {"thinking": {"kind": "enabled"}},
        {"chat_template_kwargs": {"thinking_mode": "maybe"}},
    ],
)
async def test_an_invalid_thinking_mode_is_a_400_naming_thinking(serve, fields) -> None:
    async with serve(says("never")) as s:
        response = await s.post(CHAT, chat(**fields))
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "thinking"


async def test_an_invalid_reasoning_effort_is_a_400(serve) -> None:
    async with serve(says("never")) as s:
        response = await s.post(CHAT, chat(reasoning_effort="extreme"))
    assert response.status_code == 400
    assert "reasoning_effort" in response.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "video_url"])
async def test_media_content_parts_are_refused(serve, kind) -> None:
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": kind}],
    }
    async with serve(says("never")) as s:
        response = await s.post(CHAT, {"messages": [message]})
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert kind in error["message"]
    assert error["param"] == "messages.0.content.1"


async def test_text_content_parts_are_accepted(serve) -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    async with serve(says("Hello.")) as s:
        response = await s.post(CHAT, {"messages": [message]})
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert req.messages == [message]


async def test_sampling_fields_reach_the_engine_request(serve) -> None:
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "stop": "END",
        "seed": 11,
    }
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat(**fields))
        sampling = s.engine.seen[-1].sampling
    assert sampling.temperature == 0.5
    assert sampling.top_p == 0.9
    assert sampling.top_k == 20
    assert sampling.max_new_tokens == 7  # max_completion_tokens wins over max_tokens
    assert sampling.stop == ["END"]
    assert sampling.seed == 11
    assert sampling.skip_special_tokens is False  # the parsers need the tags


async def test_unset_sampling_fields_take_the_checkpoint_defaults(serve) -> None:
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat())
        sampling = s.engine.seen[-1].sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 0.95)  # generation_config.json


async def test_max_completion_tokens_zero_is_refused_not_ignored(serve) -> None:
    # max_tokens=0 is a 400; max_completion_tokens=0 must not silently mean "no limit".
    async with serve(says("ok")) as s:
        response = await s.post(CHAT, chat(max_completion_tokens=0))
        unbounded = [r.sampling.max_new_tokens for r in s.engine.seen]
    assert unbounded == []
    assert response.status_code == 400


# ---------------------------------------------------------------------- n choices, logprobs


async def test_n_choices_have_indexes_and_seeds_in_order(serve) -> None:
    def script(req: GenerateReq) -> list[str]:
        return chop(f"<mm:think>r{req.sampling.seed}</mm:think>answer {req.sampling.seed}", 3)

    async with serve(script) as s:
        body = (await s.post(CHAT, chat(n=3, seed=40))).json()
        rids = [r.rid for r in s.engine.seen]
    assert len(set(rids)) == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [
        "answer 40",
        "answer 41",
        "answer 42",
    ]
    assert [c["message"]["reasoning_content"] for c in body["choices"]] == ["r40", "r41", "r42"]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * len(
        chop("<mm:think>r40</mm:think>answer 40", 3)
    )


async def test_n_streamed_choices_each_open_and_finish(serve) -> None:
    def script(req: GenerateReq) -> list[str]:
        return chop(f"answer {req.sampling.seed}", 2)

    async with serve(script) as s:
        events = await s.events(CHAT, chat(n=3, seed=0))
    roles = [c["index"] for e in events for c in e["choices"] if "role" in c["delta"]]
    assert roles == [0, 1, 2]
    for index in range(3):
        assert streamed(events, "content", index) == f"answer {index}"
        assert finishes(events, index) == ["stop"]
    assert all(c["logprobs"] is None for e in events for c in e["choices"])
    assert all(len(e["choices"]) == 1 for e in events)


async def test_logprobs_are_requested_from_the_engine_only_when_asked(serve) -> None:
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat())
        plain = s.engine.seen[-1].sampling
        body = (await s.post(CHAT, chat(logprobs=True, top_logprobs=3))).json()
        asked = s.engine.seen[-1].sampling
    assert (plain.logprobs, plain.top_logprobs) == (False, 0)
    assert (asked.logprobs, asked.top_logprobs) == (True, 3)
    assert body["choices"][0]["logprobs"] == {"content": []}


# ---------------------------------------------------------------------- no parsers


async def test_without_parsers_the_raw_text_is_the_content(serve) -> None:
    text = "I think\n</mm:think>\n\nThe answer is 36.\n" + WEATHER_CALL
    async with serve(says(text, 3), ApiArgs()) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER], thinking={"type": "enabled"}))).json()
        sampling = s.engine.seen[-1].sampling
        events = await s.events(CHAT, chat(tools=[WEATHER]))
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"
    assert "completion_tokens_details" not in body["usage"]
    assert sampling.skip_special_tokens is True
    assert streamed(events, "content") == text
    assert call_deltas(events) == []
    assert positions(events, "reasoning_content") == []


# ---------------------------------------------------------------------- disconnects


async def test_closing_a_stream_early_ends_the_engine_stream(serve, model_dir) -> None:
    engine = ScriptedEngine(lambda req: ["tick "] * 200, str(model_dir), delay_s=0.01)
    async with serve(engine, streaming=True) as s:
        async with s.client.stream("POST", CHAT, json=chat(stream=True)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == [engine.seen[-1].rid]
        metrics = (await s.client.get("/metrics")).text
    assert "m3serve:request_aborted_total 1" in metrics


async def test_a_client_leaving_before_a_full_response_aborts_the_request(serve, model_dir) -> None:
    engine = ScriptedEngine(lambda req: ["tick "] * 200, str(model_dir), delay_s=0.01)
    async with serve(engine, streaming=True) as s:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.post(CHAT, chat(n=2)), timeout=0.2)
        assert sorted(engine.aborted) == sorted(r.rid for r in engine.seen)
        assert len(engine.aborted) == 2
        metrics = (await s.client.get("/metrics")).text
    assert "m3serve:request_aborted_total 1" in metrics
