"""The tool-call parser: each call streams its id and name, then its whole arguments JSON typed
by the schema; an invoke the output stops inside is no call; any chunking gives the one-shot
result; malformed blocks become content."""

from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any

import pytest
from helpers.chunking import all_chunkings, token_pieces
from helpers.m3_tools import (
    block,
    calls_for,
    element,
    invoke,
    model_outputs,
    render_block,
    tool,
    toolsets,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.chat_template import render_chat
from m3serve.model.special_tokens import TOOL_CALL_START, TOOL_NAMESPACE
from m3serve.parsers.reasoning import ReasoningParser
from m3serve.parsers.tools import ToolCall, ToolCallDelta, ToolCallParser, ToolDelta

N = TOOL_NAMESPACE
BREAKS = "\r\n"
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
TEMPLATE = (
    importlib.resources.files("m3serve.model.tiny")
    .joinpath("chat_template.jinja")
    .read_text(encoding="utf-8")
)


WEATHER = tool("get_weather", {"location": {"type": "string"}, "unit": {"type": "string"}})


# Chunkings: whole, char by char, token-like (special tokens whole), random cuts.


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    """Feed ``pieces``, then finish: the content and every call delta, in order."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.content for d in deltas), check_deltas(deltas, parser.calls)


def check_deltas(deltas: list[ToolDelta], calls: list[ToolCall]) -> list[ToolCallDelta]:
    """The streaming contract: one entry per call per delta; indexes from 0 in order; id and
    name on a call's first entry only; a call's argument pieces join to its final arguments. An
    invoke the output stopped inside got its first entry (with no arguments) and is no call."""
    flat = [call for delta in deltas for call in delta.calls]
    for delta in deltas:
        assert len({c.index for c in delta.calls}) == len(delta.calls)
    indexes = sorted({c.index for c in flat})
    assert indexes == list(range(len(indexes)))
    by_id = {call.id: call for call in calls}
    assert [c.id for c in flat if c.id in by_id] == [call.id for call in calls]
    for index in indexes:
        pieces = [c for c in flat if c.index == index]
        assert pieces[0].id is not None and CALL_ID.fullmatch(pieces[0].id)
        assert all(c.id is None and c.name is None for c in pieces[1:])
        arguments = "".join(c.arguments for c in pieces)
        call = by_id.get(pieces[0].id)
        if call is None:  # cut off: only its opening was sent
            assert (index, arguments) == (indexes[-1], "")
            continue
        assert (pieces[0].name, arguments) == (call.name, call.arguments)
        assert isinstance(json.loads(call.arguments), dict)
    return flat


def pipeline(mode: str, tools: Any, pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
    """Stream through both parsers as the server does: the reasoning parser's content feeds
    the tool-call parser."""
    thinking, calling = ReasoningParser(mode), ToolCallParser(tools, seed=7)
    reasoning, deltas = [], []
    for piece in [*pieces, None]:
        split = thinking.feed(piece) if piece is not None else thinking.finish()
        reasoning.append(split.reasoning)
        deltas.append(calling.feed(split.content))
    deltas.append(calling.finish())
    check_deltas(deltas, calling.calls)
    return "".join(reasoning), "".join(d.content for d in deltas), calling.calls


@settings(max_examples=200, deadline=None)
@given(model_outputs(), st.integers(0, 2**32), st.lists(st.integers(0, 10**6), max_size=10))
def test_model_outputs_parse_the_same_in_any_chunking(
    case: dict[str, Any], seed: int, points: list[int]
) -> None:
    split = ReasoningParser(case["mode"]).parse(case["text"])
    content, calls = ToolCallParser(case["tools"], seed=7).parse(split.content)
    assert (split.reasoning, content) == (case["reasoning"], case["content"])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == case["calls"]
    for pieces in all_chunkings(case["text"], seed, points):
        assert pipeline(case["mode"], case["tools"], pieces) == (split.reasoning, content, calls)


MALFORMED_PIECES = [N, N, "<tool_call>", "</tool_call>", '<invoke name="f">', '<invoke name="g">']
MALFORMED_PIECES += ["</invoke>", "<a>", "</a>", "<item>", "</item>", '<parameter name="p">']
MALFORMED_PIECES += ["</parameter>", "<b/>", "\n", "<", ">", "]", "]<]", '{"x": 1}', "1", "true"]
F_TOOL = tool("f", {"a": {"type": "integer"}, "p": {"type": "array", "items": {"type": "number"}}})


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(MALFORMED_PIECES), st.text(max_size=3)), max_size=25),
    st.sampled_from([None, [F_TOOL]]),
    st.integers(0, 2**32),
    st.lists(st.integers(0, 10**6), max_size=10),
)
def test_malformed_output_never_raises_and_streams_like_one_shot(
    parts: list[str], tools: Any, seed: int, points: list[int]
) -> None:
    text = "".join(parts)
    content, calls = ToolCallParser(tools, seed=1).parse(text)
    if TOOL_CALL_START not in text or f"{N}<invoke" not in text:
        assert (content, calls) == (text, [])
    for pieces in all_chunkings(text, seed, points):
        parser = ToolCallParser(tools, seed=1)
        assert stream(parser, pieces)[0] == content
        assert parser.calls == calls


@settings(max_examples=50, deadline=None)
@given(toolsets().flatmap(lambda tools: calls_for(tools)))
def test_renderer_matches_the_chat_template(calls: list[tuple[str, dict[str, Any]]]) -> None:
    """The test renderer writes calls exactly as the chat template shows them to the model."""
    message = {
        "role": "assistant",
        "content": "On it.",
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    prompt = render_chat(
        TEMPLATE, [{"role": "user", "content": "hi"}, message], add_generation_prompt=False
    )
    turn = prompt.split("]~b]ai\n</mm:think>", 1)[1].removesuffix("[e~[\n")
    assert turn == "On it." + (render_block(calls) if calls else "")


# Crafted cases.

F3_EXAMPLE = (
    f"Checking.{N}<tool_call>\n"
    f'{N}<invoke name="get_weather">{N}<location>Beijing{N}</location>{N}<unit>celsius{N}</unit>'
    f"{N}</invoke>\n"
    f'{N}<invoke name="other">{N}<days>3{N}</days>{N}</invoke>\n'
    f"{N}</tool_call>"
)


def test_section_f3_example_streams_id_and_name_first_then_whole_arguments() -> None:
    tools = [WEATHER, tool("other", {"days": {"type": "integer"}})]
    parser = ToolCallParser(tools, seed=3)
    content, flat = stream(parser, token_pieces(F3_EXAMPLE, 0))
    assert content == "Checking."
    first, second = parser.calls
    assert [(c.index, c.id, c.name, c.arguments) for c in flat] == [
        (0, first.id, "get_weather", ""),
        (0, None, None, '{"location": "Beijing", "unit": "celsius"}'),
        (1, second.id, "other", ""),
        (1, None, None, '{"days": 3}'),
    ]
    assert first.id != second.id
    assert ToolCallParser(tools, seed=3).parse(F3_EXAMPLE) == ("Checking.", [first, second])


def test_arguments_wait_for_the_end_of_the_invoke() -> None:
    """A value streamed early could still change: a later sibling turns it into an array."""
    parser = ToolCallParser(None, seed=0)
    opened = parser.feed(f'{TOOL_CALL_START}{N}<invoke name="f">' + element("tag", "a"))
    assert [(c.name, c.arguments) for c in opened.calls] == [("f", "")]
    assert parser.feed(element("x", "1") + element("tag", "b")).calls == []
    ended = parser.feed(f"{N}</invoke>")
    assert [c.arguments for c in ended.calls] == ['{"tag": ["a", "b"], "x": "1"}']


def test_a_whole_output_in_one_piece_gives_one_entry_per_call() -> None:
    delta = ToolCallParser(None, seed=0).feed(F3_EXAMPLE)
    assert delta.content == "Checking."
    assert [(c.index, c.name, c.arguments) for c in delta.calls] == [
        (0, "get_weather", '{"location": "Beijing", "unit": "celsius"}'),
        (1, "other", '{"days": "3"}'),  # no schema: text stays text
    ]


def test_zero_argument_call() -> None:
    text = block(invoke("now", ""))
    parser = ToolCallParser([tool("now")], seed=0)
    _, flat = stream(parser, token_pieces(text, 1))
    assert [(c.name, c.arguments) for c in flat] == [("now", ""), (None, "{}")]
    assert parser.calls[0].arguments == "{}"


def test_unknown_tools_are_dropped_unless_no_tools_were_given() -> None:
    text = block(
        invoke("rm_rf", element("path", "/")), invoke("get_weather", element("location", "Oslo"))
    )
    content, calls = ToolCallParser([WEATHER]).parse(text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"location": "Oslo"}')]
    parser = ToolCallParser([WEATHER])
    assert [c.index for c in parser.feed(text).calls] == [0]
    for tools in (None, []):
        assert [c.name for c in ToolCallParser(tools).parse(text)[1]] == ["rm_rf", "get_weather"]
    only_unknown = f'{TOOL_CALL_START}{N}<invoke name="rm_rf">{N}</invoke>{N}</tool_call>tail'
    assert ToolCallParser([WEATHER]).parse(only_unknown) == ("tail", [])


def test_parameter_spelling_and_layout_tolerance() -> None:
    text = (
        f'{TOOL_CALL_START}{N}<invoke name="get_weather">\n{N}<parameter name="location">Paris'
        f"{N}</parameter>\n{N}<unit>celsius{N}</unit>\n{N}</invoke>"
        f'{N}<invoke name="get_weather">{N}<location>Rome{N}</location>'  # no </invoke>
        f"{N}<invoke name = 'get_weather'>{N}<location>Nice{N}</invoke>\n\n\n"  # no </location>
        f"{N}</tool_call>"
    )
    _, calls = ToolCallParser([WEATHER]).parse(text)
    assert [json.loads(c.arguments) for c in calls] == [
        {"location": "Paris", "unit": "celsius"},
        {"location": "Rome"},
        {"location": "Nice"},
    ]


def test_text_after_the_block_is_content_again() -> None:
    text = f'Before.{TOOL_CALL_START}{N}<invoke name="f">{N}</invoke>{N}</tool_call>\nAfter ]<]x'
    for pieces in all_chunkings(text, 2, [5, 40]):
        assert stream(ToolCallParser(None), pieces)[0] == "Before.\nAfter ]<]x"


@pytest.mark.parametrize(
    "text",
    [
        f"{TOOL_CALL_START}\nI changed my mind.\n{N}</tool_call> Done.",  # no invoke, closed
        f"Answer {TOOL_CALL_START}\n{N}<invoke",  # cut off before an invoke was read
        f"{TOOL_CALL_START}{N}<get_weather>{N}</get_weather>{N}</tool_call>",  # no invoke tag
        f"{TOOL_CALL_START}{N}</tool_call>",  # empty block
        f'{N}<invoke name="f">{N}</invoke>',  # no block start: not a call
        f"a]b]<]c]<]minimax[>d {N}x {N}< {N}<tool_ {TOOL_CALL_START[:-1]}",
    ],
)
def test_blocks_without_an_invoke_are_returned_verbatim(text: str) -> None:
    for pieces in all_chunkings(text, 3, [4, 9, 17]):
        assert stream(ToolCallParser(None), pieces)[0] == text
    assert ToolCallParser(None).parse(text) == (text, [])


CUT_OFF = [
    f'{N}<invoke name="get_weather">',
    f'{N}<invoke name="get_weather">{N}<location>Oslo{N}</location>{N}<unit>cel',
    f'{N}<invoke name="get_weather">{N}<location>Oslo{N}</location>',
    f'{N}<invoke name="get_weather">{N}<location>Oslo{N}</location>{N}</invo',
]


@pytest.mark.parametrize("cut", CUT_OFF)
def test_an_invoke_the_output_stops_inside_is_not_a_call(cut: str) -> None:
    done = invoke("get_weather", element("location", "Bergen"))
    text = f"Sure.{TOOL_CALL_START}\n{done}\n{cut}"
    for pieces in all_chunkings(text, 5, [8, 30, 90]):
        parser = ToolCallParser([WEATHER], seed=2)
        content, flat = stream(parser, pieces)
        assert content == "Sure."
        (call,) = parser.calls
        assert json.loads(call.arguments) == {"location": "Bergen"}
        # The cut invoke's id and name went out as it opened; nothing else of it did.
        assert [(c.index, c.name, c.arguments) for c in flat if c.index == 1] == [
            (1, "get_weather", "")
        ]
    assert ToolCallParser([WEATHER], seed=2).parse(text) == ("Sure.", [call])


def test_hold_back_is_the_longest_possible_marker_start() -> None:
    parser = ToolCallParser(None)
    assert parser.feed("a]") == ToolDelta("a", [])
    assert parser.feed("]<]") == ToolDelta("]", [])  # "]]<]": only "]<]" can still be N
    assert parser.feed("minimax[>") == ToolDelta("", [])
    assert parser.feed("[<tool") == ToolDelta("", [])
    assert parser.feed("s") == ToolDelta("]<]minimax[>[<tools", [])
    assert parser.feed("]<]<") == ToolDelta("]<", [])
    assert parser.finish() == ToolDelta("]<", [])


def test_a_code_value_round_trips_exactly() -> None:
    code = '\n    def f(x):\n\treturn x < 1 and "a" > "b"\n\n\n'
    schema = {"code": {"type": "string"}, "n": {"type": "integer"}}
    text = block(invoke("w", element("code", code) + element("n", " 7\n")))
    for pieces in all_chunkings(text, 4, [11, 60]):
        parser = ToolCallParser([tool("w", schema)])
        stream(parser, pieces)
        assert json.loads(parser.calls[0].arguments) == {"code": code, "n": 7}


def test_raw_json_body_and_empty_elements() -> None:
    body = block(invoke("f", '\n{"a": [1, 2]}\n'))
    assert json.loads(ToolCallParser(None).parse(body)[1][0].arguments) == {"a": [1, 2]}
    empty = f'{TOOL_CALL_START}{N}<invoke name="f">{N}<flag/>{N}<list>{N}</list>{N}</invoke>'
    schema = {"list": {"type": "array"}}
    assert json.loads(ToolCallParser([tool("f", schema)]).parse(empty)[1][0].arguments) == {
        "flag": "",
        "list": [],
    }


def test_arguments_are_typed_by_the_tool_schema_and_its_defs() -> None:
    address = {
        "type": "object",
        "properties": {"zip": {"type": "string"}, "floor": {"type": "integer"}},
    }
    booking = tool(
        "book",
        {"to": {"$ref": "#/$defs/Address"}, "guests": {"type": ["integer", "null"]}},
        **{"$defs": {"Address": address}},
    )
    body = element("to", element("zip", "02139") + element("floor", "3")) + element("guests", "2")
    _, calls = ToolCallParser([booking]).parse(block(invoke("book", body)))
    assert json.loads(calls[0].arguments) == {"to": {"zip": "02139", "floor": 3}, "guests": 2}


def test_ids_are_prefixed_hex_and_reproducible_with_a_seed() -> None:
    text = f'{TOOL_CALL_START}{N}<invoke name="a">{N}</invoke>{N}<invoke name="b">{N}</invoke>'
    ids = [c.id for c in ToolCallParser(None, id_prefix="call_", seed=5).parse(text)[1]]
    assert ids == [c.id for c in ToolCallParser(None, seed=5).parse(text)[1]]
    assert len(set(ids)) == 2 and all(CALL_ID.fullmatch(i) for i in ids)
    unseeded = ToolCallParser(None, id_prefix="tool-").parse(text)[1]
    assert all(re.fullmatch(r"tool-[0-9a-f]{24}", c.id) for c in unseeded)


def test_deep_nesting_does_not_raise() -> None:
    deep = f"{N}<item>" * 5000 + "x"
    text = block(invoke("f", f"{N}<v>{deep}{N}</v>"))
    _, calls = ToolCallParser(None).parse(text)
    assert isinstance(json.loads(calls[0].arguments)["v"], list)
