"""The tool-call parser: calls stream name first then argument fragments that join to the final
JSON, typed by schema; any chunking gives the one-shot result; malformed blocks become content."""

from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any

import pytest
from helpers.chunking import all_chunkings, token_pieces
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.chat_template import render_chat
from m3serve.model.special_tokens import THINK_END, THINK_START, TOOL_CALL_START, TOOL_NAMESPACE
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


def tool(name: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties or {}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = tool("get_weather", {"location": {"type": "string"}, "unit": {"type": "string"}})


# Chunkings: whole, char by char, token-like (special tokens whole), random cuts.


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    """Feed ``pieces``, then finish: the content and every call delta, in order."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.content for d in deltas), check_deltas(deltas, parser.calls)


def check_deltas(deltas: list[ToolDelta], calls: list[ToolCall]) -> list[ToolCallDelta]:
    """The streaming contract: one entry per call per delta; id and name on a call's first
    entry only; a call's argument pieces join to its final arguments."""
    flat = [call for delta in deltas for call in delta.calls]
    for delta in deltas:
        assert len({c.index for c in delta.calls}) == len(delta.calls)
    assert sorted({c.index for c in flat}) == list(range(len(calls)))
    for index, call in enumerate(calls):
        pieces = [c for c in flat if c.index == index]
        assert (pieces[0].id, pieces[0].name) == (call.id, call.name)
        assert all(c.id is None and c.name is None for c in pieces[1:])
        assert "".join(c.arguments for c in pieces) == call.arguments
        assert isinstance(json.loads(call.arguments), dict)
        assert CALL_ID.fullmatch(call.id)
    return flat


# Rendering calls the way the chat template does (checked against it below).


def render_element(name: str, value: Any, parameter_spelling: bool = False) -> str:
    opener, closer = (f'<parameter name="{name}">', "</parameter>")
    if not parameter_spelling:
        opener, closer = f"<{name}>", f"</{name}>"
    if isinstance(value, dict):
        inner = "".join(render_element(k, v) for k, v in value.items())
    elif isinstance(value, list):
        inner = "".join(render_element("item", v) for v in value)
    elif isinstance(value, str):
        inner = value
    else:  # numbers, booleans and null as JSON, like the template's tojson
        inner = json.dumps(value)
    return f"{N}{opener}{inner}{N}{closer}"


def render_block(
    calls: list[tuple[str, dict[str, Any]]], separator: str = "\n", parameter_spelling: bool = False
) -> str:
    invokes = "".join(
        f'{N}<invoke name="{name}">'
        + "".join(render_element(k, v, parameter_spelling) for k, v in args.items())
        + f"{N}</invoke>{separator}"
        for name, args in calls
    )
    return f"{TOOL_CALL_START}{separator}{invokes}{N}</tool_call>"


# Strategies.

# Parameters named like the block's own tags (invoke, tool_call) could not be told apart from
# them; "item" is fine where a schema says the parent is an object.
names = st.sampled_from(["location", "unit", "a", "b_2", "x", "item", "query", "n", "días", "k-9"])
STRING_PIECES = ["<", ">", "</a>", "<b>", "]", "]<]", "]<]minimax[>", "[>[", '"', "\\", "{}"]
STRING_PIECES += ["[1]", "\n", " ", "日本", "😀", "null", "true", "1", "&amp;", "<item>"]
strings = (
    st.lists(
        st.one_of(
            st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=5),
            st.sampled_from(STRING_PIECES),
        ),
        max_size=4,
    )
    .map("".join)
    # One line break at each end of a value is layout (stripped), and N would end the value.
    .filter(lambda s: N not in s and not s.startswith("\n") and not s.endswith("\n"))
)
integers = st.integers(-(10**15), 10**15)
numbers = st.floats(allow_nan=False, allow_infinity=False)
SCALAR_SCHEMAS = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["integer", "null"]},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
]
schemas = st.recursive(
    st.sampled_from(SCALAR_SCHEMAS),
    lambda inner: st.one_of(
        st.dictionaries(names, inner, max_size=3).map(
            lambda props: {"type": "object", "properties": props}
        ),
        inner.map(lambda items: {"type": "array", "items": items}),
    ),
    max_leaves=6,
)


def values_for(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that the schema types unambiguously (a nullable string is never "null")."""
    if "anyOf" in schema:
        return st.one_of(st.none(), strings.filter(lambda s: s.strip().lower() != "null"))
    kind = schema["type"]
    if kind == ["integer", "null"]:
        return st.one_of(st.none(), integers)
    if kind == "object":
        optional = {k: values_for(v) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries({}, optional=optional)
    if kind == "array":
        return st.lists(values_for(schema["items"]), max_size=3)
    return {
        "string": strings,
        "integer": integers,
        "number": numbers,
        "boolean": st.booleans(),
        "null": st.none(),
    }[kind]


@st.composite
def toolsets(draw: st.DrawFn) -> list[dict[str, Any]]:
    tool_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    return [tool(name, draw(st.dictionaries(names, schemas, max_size=4))) for name in tool_names]


@st.composite
def calls_for(draw: st.DrawFn, tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """0-3 calls; some to a tool that was not offered (to be dropped)."""
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 4)) == 0:
            args = draw(st.dictionaries(names, strings, max_size=2))
            calls.append((f"not.offered.{draw(names)}", args))
            continue
        function = draw(st.sampled_from(tools))["function"]
        calls.append((function["name"], draw(values_for(function["parameters"]))))
    return calls


# Free text that never holds N or a think tag but plenty that looks like a start of one.
ANSWER_PIECES = ["<", ">", "]", "]<]", "]]<]", "]<]minimax[>", "[>[", "<tool_call>"]
ANSWER_PIECES += ["</tool_call>", '<invoke name="f">', "<mm:thi", "</mm:", "\n", " ", "ñ", "🙂"]
free_text = (
    st.lists(
        st.one_of(
            st.text(st.characters(codec="utf-8"), max_size=6), st.sampled_from(ANSWER_PIECES)
        ),
        max_size=6,
    )
    .map("".join)
    .filter(lambda s: N not in s and THINK_START not in s and THINK_END not in s)
)


@st.composite
def model_outputs(draw: st.DrawFn) -> dict[str, Any]:
    """A whole model output in some thinking mode, with what the parsers should make of it."""
    tools = draw(toolsets())
    calls = draw(calls_for(tools))
    answer, trailing, reasoning = draw(free_text), draw(free_text), draw(free_text)
    separator = draw(st.sampled_from(["\n", "", "\n\n", " \n"]))
    block = render_block(calls, separator, draw(st.booleans())) if calls else ""
    mode = draw(st.sampled_from(["enabled", "disabled", "adaptive"]))
    shapes = {"enabled": ["think"], "disabled": ["", "stray"], "adaptive": ["", "stray", "think"]}
    shape = draw(st.sampled_from(shapes[mode]))
    prefix = {"": "", "stray": THINK_END, "think": reasoning + THINK_END}[shape]
    if mode == "adaptive" and shape == "think":
        prefix = THINK_START + prefix
    # Line breaks after a think tag are dropped, be it in the output or at the end of the prompt.
    after_tag = mode != "adaptive" or shape != ""
    answer_part = answer + block + trailing
    content = answer_part.lstrip(BREAKS) if after_tag else answer_part
    offered = {t["function"]["name"] for t in tools}
    return {
        "mode": mode,
        "tools": tools,
        "text": prefix + answer_part,
        "reasoning": reasoning.strip(BREAKS) if shape == "think" else "",
        "content": content.replace(block, "", 1),
        "calls": [(name, args) for name, args in calls if name in offered],
    }


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


def test_section_f3_example_streams_name_first_then_argument_fragments() -> None:
    tools = [WEATHER, tool("other", {"days": {"type": "integer"}})]
    parser = ToolCallParser(tools, seed=3)
    content, flat = stream(parser, token_pieces(F3_EXAMPLE, 0))
    assert content == "Checking."
    first, second = parser.calls
    assert [(c.index, c.id, c.name, c.arguments) for c in flat] == [
        (0, first.id, "get_weather", ""),
        (0, None, None, '{"location": "Beijing"'),
        (0, None, None, ', "unit": "celsius"'),
        (0, None, None, "}"),
        (1, second.id, "other", ""),
        (1, None, None, '{"days": 3'),
        (1, None, None, "}"),
    ]
    assert json.loads(first.arguments) == {"location": "Beijing", "unit": "celsius"}
    assert second.arguments == '{"days": 3}'
    assert first.id != second.id
    assert ToolCallParser(tools, seed=3).parse(F3_EXAMPLE) == ("Checking.", [first, second])


def test_a_whole_output_in_one_piece_gives_one_entry_per_call() -> None:
    delta = ToolCallParser(None, seed=0).feed(F3_EXAMPLE)
    assert delta.content == "Checking."
    assert [(c.index, c.name, c.arguments) for c in delta.calls] == [
        (0, "get_weather", '{"location": "Beijing", "unit": "celsius"}'),
        (1, "other", '{"days": "3"}'),  # no schema: text stays text
    ]


def test_zero_argument_call() -> None:
    text = f'{TOOL_CALL_START}\n{N}<invoke name="now">{N}</invoke>\n{N}</tool_call>'
    parser = ToolCallParser([tool("now")], seed=0)
    _, flat = stream(parser, token_pieces(text, 1))
    assert [(c.name, c.arguments) for c in flat] == [("now", ""), (None, "{}")]
    assert parser.calls[0].arguments == "{}"


def test_unknown_tools_are_dropped_unless_no_tools_were_given() -> None:
    text = (
        f'{TOOL_CALL_START}\n{N}<invoke name="rm_rf">{N}<path>/{N}</path>{N}</invoke>\n'
        f'{N}<invoke name="get_weather">{N}<location>Oslo{N}</location>{N}</invoke>\n'
        f"{N}</tool_call>"
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
        f'{TOOL_CALL_START}{N}<invoke name="get_weather">\n{N}<parameter name="location">\nParis\n'
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


def test_a_cut_off_invoke_keeps_its_completed_parameters() -> None:
    text = (
        f'{TOOL_CALL_START}\n{N}<invoke name="get_weather">'
        f"{N}<location>Oslo{N}</location>{N}<unit>cel"
    )
    parser = ToolCallParser([WEATHER])
    first = parser.feed(text)
    assert [c.arguments for c in first.calls] == ['{"location": "Oslo"']
    assert [c.arguments for c in parser.finish().calls] == ["}"]
    assert parser.calls[0].arguments == '{"location": "Oslo"}'
    assert ToolCallParser([WEATHER]).parse(text)[1][0].arguments == '{"location": "Oslo"}'


def test_hold_back_is_the_longest_possible_marker_start() -> None:
    parser = ToolCallParser(None)
    assert parser.feed("a]") == ToolDelta("a", [])
    assert parser.feed("]<]") == ToolDelta("]", [])  # "]]<]": only "]<]" can still be N
    assert parser.feed("minimax[>") == ToolDelta("", [])
    assert parser.feed("[<tool") == ToolDelta("", [])
    assert parser.feed("s") == ToolDelta("]<]minimax[>[<tools", [])
    assert parser.feed("]<]<") == ToolDelta("]<", [])
    assert parser.finish() == ToolDelta("]<", [])


def test_values_keep_raw_text_and_unprefixed_markup() -> None:
    schema = {"code": {"type": "string"}, "n": {"type": "integer"}}
    text = (
        f'{TOOL_CALL_START}{N}<invoke name="w">{N}<code>\n<div a="1">x &amp; y</div>\n\n{N}</code>'
        f"{N}<n> 7 {N}</n>{N}</invoke>{N}</tool_call>"
    )
    _, calls = ToolCallParser([tool("w", schema)]).parse(text)
    assert json.loads(calls[0].arguments) == {"code": '<div a="1">x &amp; y</div>\n', "n": 7}


def test_raw_json_body_and_empty_elements() -> None:
    body = f'{TOOL_CALL_START}{N}<invoke name="f">\n{{"a": [1, 2]}}\n{N}</invoke>{N}</tool_call>'
    assert json.loads(ToolCallParser(None).parse(body)[1][0].arguments) == {"a": [1, 2]}
    empty = f'{TOOL_CALL_START}{N}<invoke name="f">{N}<flag/>{N}<list>{N}</list>{N}</invoke>'
    schema = {"list": {"type": "array"}}
    assert json.loads(ToolCallParser([tool("f", schema)]).parse(empty)[1][0].arguments) == {
        "flag": "",
        "list": [],
    }


def element(name: str, inner: str) -> str:
    return f"{N}<{name}>{inner}{N}</{name}>"


@pytest.mark.parametrize(
    ("schema", "inner", "value"),
    [
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, "\n-3.0\n", -3),
        ({"type": "integer"}, "2.5", 2.5),
        ({"type": "integer"}, "many", "many"),
        ({"type": "number"}, "1e3", 1000.0),
        ({"type": "number"}, "7", 7),
        ({"type": "number"}, "NaN", "NaN"),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, " false ", False),
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "null"}, "null", None),
        ({"type": "string"}, "\n\n 12 \n\n", "\n 12 \n"),
        ({"type": ["string", "null"]}, "null", None),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "5", 5),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "five", "five"),
        ({"type": "object"}, '{"k": [1]}', {"k": [1]}),
        ({"type": "object"}, element("k", "1"), {"k": "1"}),
        (
            {"type": "object", "properties": {"k": {"type": "integer"}}},
            element("k", "1") + element("j", "true"),
            {"k": 1, "j": "true"},
        ),
        ({"type": "object"}, "not json", "not json"),
        ({"type": "array"}, "[1, 2]", [1, 2]),
        (
            {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}},
            element("item", element("item", "true") + element("item", "FALSE")),
            [[True, False]],
        ),
        ({"type": "array", "items": {"type": "number"}}, "", []),
        ({"properties": {"x": {"type": "integer"}}}, element("x", "2"), {"x": 2}),
        ({"type": "string"}, '{"a": 1}', '{"a": 1}'),
        (None, '{"a": 1}', {"a": 1}),
        (None, "[true]", [True]),
        (None, "12", "12"),
        (None, element("item", "a") + element("item", "b"), ["a", "b"]),
        (None, element("x", "a") + element("item", "b"), {"x": "a", "item": "b"}),
        ({"type": "integer"}, "1" * 5000, "1" * 5000),
        ({"type": "object"}, "[" * 100000, "[" * 100000),
    ],
)
def test_values_are_typed_by_schema(schema: Any, inner: str, value: Any) -> None:
    properties = {"v": schema} if schema is not None else {}
    text = f'{TOOL_CALL_START}{N}<invoke name="f">{element("v", inner)}{N}</invoke>{N}</tool_call>'
    tools = [tool("f", properties)] if schema is not None else None
    _, calls = ToolCallParser(tools).parse(text)
    assert json.loads(calls[0].arguments) == {"v": value}


def test_ids_are_prefixed_hex_and_reproducible_with_a_seed() -> None:
    text = f'{TOOL_CALL_START}{N}<invoke name="a">{N}</invoke>{N}<invoke name="b">{N}</invoke>'
    ids = [c.id for c in ToolCallParser(None, id_prefix="call_", seed=5).parse(text)[1]]
    assert ids == [c.id for c in ToolCallParser(None, seed=5).parse(text)[1]]
    assert len(set(ids)) == 2 and all(CALL_ID.fullmatch(i) for i in ids)
    unseeded = ToolCallParser(None, id_prefix="tool-").parse(text)[1]
    assert all(re.fullmatch(r"tool-[0-9a-f]{24}", c.id) for c in unseeded)


def test_deep_nesting_does_not_raise() -> None:
    deep = f"{N}<item>" * 5000 + "x"
    text = f'{TOOL_CALL_START}{N}<invoke name="f">{N}<v>{deep}{N}</v>{N}</invoke>{N}</tool_call>'
    _, calls = ToolCallParser(None).parse(text)
    assert isinstance(json.loads(calls[0].arguments)["v"], list)
