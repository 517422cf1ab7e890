"""A Responses request as the chat request it means: input items to chat messages, function
tools and tool_choice to chat's, and every refusal a 400 naming the Responses field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from m3serve.api.errors import APIError
from m3serve.api.protocol import ResponsesRequest, to_builtins
from m3serve.api.response_input import chat_request

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def request(**fields: Any) -> ResponsesRequest:
    return msgspec.convert({"input": "hi", **fields}, ResponsesRequest)


def messages(**fields: Any) -> list[dict[str, Any]]:
    return [to_builtins(m) for m in chat_request(request(**fields)).messages]


def refusal(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        chat_request(request(**fields))
    assert caught.value.status == 400
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert messages(instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_message_items_keep_their_role_and_join_their_text_parts() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "there"},
        ]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
    ]  # fmt: skip
    assert messages(input=items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Hello, there"},
        {"role": "assistant", "content": "Hi!"},
    ]


def test_function_calls_join_the_assistant_turn_and_outputs_become_tool_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip
    got = messages(input=items)
    assert [m["role"] for m in got] == ["user", "assistant", "tool", "tool"]
    assistant = got[1]
    assert assistant["content"] == "Let me look."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in assistant["tool_calls"]] == [
        ("call_a", "get_weather", '{"city": "Paris"}'),
        ("call_b", "get_weather", '{"city": "Rome"}'),
    ]  # fmt: skip
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_a"}
    assert got[3] == {"role": "tool", "content": "rain", "tool_call_id": "call_b"}


def test_a_function_call_with_no_assistant_message_before_it_opens_its_own_turn() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
    ]
    got = messages(input=items)
    assert got[1]["role"] == "assistant" and "content" not in got[1]
    assert [c["id"] for c in got[1]["tool_calls"]] == ["c"]


def test_function_tools_tool_choice_and_sampling_carry_over_to_chat() -> None:
    chat = chat_request(
        request(
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=7,
            temperature=0.5,
            top_p=0.9,
            reasoning={"effort": "low"},
            parallel_tool_calls=False,
            stream=True,
        )
    )
    (tool,) = chat.tools or []
    assert (tool.type, tool.function.name, tool.function.parameters) == (
        "function", "get_weather", {"type": "object"},
    )  # fmt: skip
    assert chat.tool_choice.function.name == "get_weather"  # type: ignore[union-attr]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    assert (chat.reasoning_effort, chat.parallel_tool_calls, chat.stream) == ("low", False, True)


def test_the_chat_endpoints_extensions_carry_over_too() -> None:
    chat = chat_request(
        request(thinking={"type": "enabled"}, top_k=5, seed=7, stop="END", stop_token_ids=[3])
    )
    assert chat.thinking is not None and chat.thinking.type == "enabled"
    assert (chat.top_k, chat.seed, chat.stop, chat.stop_token_ids) == (5, 7, "END", [3])


def test_text_format_becomes_chats_response_format() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    body = chat_request(request(text={"format": fmt}))
    assert body.response_format is not None and body.response_format.json_schema is not None
    assert body.response_format.type == "json_schema"
    spec = body.response_format.json_schema
    assert (spec.name, spec.schema_, spec.strict) == ("place", schema, True)
    plain = chat_request(request(text={"format": {"type": "json_object"}})).response_format
    assert plain is not None and plain.type == "json_object"
    assert chat_request(request(text={"format": {"type": "text"}})).response_format is None


def test_store_is_accepted_and_stores_nothing() -> None:
    assert messages(store=True) == messages(store=False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_served_is_a_bad_request_naming_its_field(
    fields: dict[str, Any], param: str
) -> None:
    error = refusal(**fields)
    assert error.param == param
    assert error.message


def test_the_stateful_refusal_says_that_nothing_is_stored() -> None:
    assert "stateful responses are not supported" in refusal(previous_response_id="r").message
