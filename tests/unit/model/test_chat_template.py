"""The MiniMax-M3 chat template (tiny checkpoints) and our HF-compatible template renderer."""

from __future__ import annotations

import copy
import importlib.resources
import json
import pathlib
from typing import Any

import pytest

from m3serve.model.chat_template import ChatTemplateError, load_chat_template, render_chat
from m3serve.model.tiny.tokenizer import write_tokenizer_files

TEMPLATE = (
    importlib.resources.files("m3serve.model.tiny")
    .joinpath("chat_template.jinja")
    .read_text(encoding="utf-8")
)

SYSTEM_HEAD = (
    "]~!b[]~b]system\n"
    "You are MiniMax-M3.1, a helpful AI assistant developed by MiniMax.\n\n"
    "<thinking_instructions>\n"
    "When you think, put your reasoning inside <mm:think></mm:think> before your final answer.\n"
)
MODE_LINES = {
    "enabled": "Current thinking mode: enabled.",
    "disabled": "Current thinking mode: disabled. "
    "Begin your response directly after the </mm:think> prefix.",
    "adaptive": "Current thinking mode: adaptive. Decide whether to think before answering.",
}
SYSTEM_TAIL = "\n</thinking_instructions>[e~[\n"
DEFAULT_DEVELOPER = "]~b]developer\nYou are a helpful assistant.[e~[\n"
HELLO = [{"role": "user", "content": "Hello!"}]
NS = "]<]minimax[>["

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
BOOK_TOOL = {
    "name": "book",
    "description": "Book <seats> for “guests”.",
    "parameters": {"type": "object", "properties": {"guests": {"type": "array"}}},
}
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Beijing, then book for Ada and Bo."},
    {
        "role": "assistant",
        "content": "<mm:think>Two calls needed.</mm:think>On it.",
        "reasoning_content": "Two calls needed.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"location": "Beijing", "options": {"unit": "celsius", '
                    '"days": 2, "hourly": false}}',
                },
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {
                    "name": "book",
                    "arguments": {
                        "guests": [{"name": "Ada", "age": 36}, {"name": "Bo", "vip": True}],
                        "tags": [["a", "b"], []],
                        "price": 12.5,
                        "note": None,
                    },
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "booked"},
]


def system_block(mode: str, effort: str | None = None) -> str:
    effort_line = f"\n<effort>{effort}</effort>" if effort else ""
    return SYSTEM_HEAD + MODE_LINES[mode] + effort_line + SYSTEM_TAIL


@pytest.mark.parametrize(
    ("mode", "prefix"), [("enabled", "<mm:think>"), ("disabled", "</mm:think>"), ("adaptive", "")]
)
def test_plain_user_turn_in_each_mode(mode: str, prefix: str) -> None:
    expected = (
        SYSTEM_HEAD
        + MODE_LINES[mode]
        + SYSTEM_TAIL
        + "]~b]developer\nYou are a helpful assistant.[e~[\n"
        + "]~b]user\nHello![e~[\n"
        + "]~b]ai\n"
        + prefix
    )
    assert render_chat(TEMPLATE, HELLO, thinking_mode=mode) == expected


def test_adaptive_is_the_default() -> None:
    adaptive = render_chat(TEMPLATE, HELLO, thinking_mode="adaptive")
    assert render_chat(TEMPLATE, HELLO) == adaptive
    assert render_chat(TEMPLATE, HELLO, thinking_mode=None) == adaptive
    assert adaptive.endswith("]~b]user\nHello![e~[\n]~b]ai\n")


def test_no_generation_prompt() -> None:
    rendered = render_chat(TEMPLATE, HELLO, add_generation_prompt=False, thinking_mode="enabled")
    assert rendered == system_block("enabled") + DEFAULT_DEVELOPER + "]~b]user\nHello![e~[\n"


@pytest.mark.parametrize(("mode", "effort"), [("adaptive", "high"), ("enabled", "max")])
def test_reasoning_effort_is_injected(mode: str, effort: str) -> None:
    rendered = render_chat(TEMPLATE, HELLO, thinking_mode=mode, reasoning_effort=effort)
    expected_head = SYSTEM_HEAD + MODE_LINES[mode] + f"\n<effort>{effort}</effort>" + SYSTEM_TAIL
    assert rendered.startswith(expected_head + DEFAULT_DEVELOPER)


def test_reasoning_effort_is_ignored_when_disabled() -> None:
    plain = render_chat(TEMPLATE, HELLO, thinking_mode="disabled")
    assert render_chat(TEMPLATE, HELLO, thinking_mode="disabled", reasoning_effort="high") == plain
    assert "<effort>" not in plain


def test_unknown_reasoning_effort_raises() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown reasoning_effort 'huge'"):
        render_chat(TEMPLATE, HELLO, reasoning_effort="huge")


def test_unknown_thinking_mode_raises() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown thinking_mode 'sometimes'"):
        render_chat(TEMPLATE, HELLO, thinking_mode="sometimes")


def test_unknown_role_raises() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown message role: narrator"):
        render_chat(TEMPLATE, [{"role": "narrator", "content": "x"}])


def test_system_prompts() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "Now be verbose."},
    ]
    expected = (
        system_block("adaptive")
        + "]~b]developer\nYou are terse.[e~[\n"
        + "]~b]user\nHi[e~[\n"
        + "]~b]developer\nNow be verbose.[e~[\n"
        + "]~b]ai\n"
    )
    assert render_chat(TEMPLATE, messages) == expected


def test_past_thinking_is_stripped() -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<mm:think>Easy.</mm:think>4", "reasoning_content": "E"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    expected = (
        system_block("enabled")
        + DEFAULT_DEVELOPER
        + "]~b]user\n2+2?[e~[\n"
        + "]~b]ai\n</mm:think>4[e~[\n"
        + "]~b]user\nAnd 3+3?[e~[\n"
        + "]~b]ai\n</mm:think>6[e~[\n"
    )
    rendered = render_chat(TEMPLATE, messages, add_generation_prompt=False, thinking_mode="enabled")
    assert rendered == expected


def test_tools_tool_calls_and_merged_results() -> None:
    rendered = render_chat(
        TEMPLATE, TOOL_CONVERSATION, tools=[WEATHER_TOOL, BOOK_TOOL], thinking_mode="enabled"
    )
    expected = system_block("enabled") + (
        "]~b]developer\nBe brief.\n\n# Tools\n"
        "You may call one or more tools to assist with the user query.\n"
        "Here are the tools available in JSONSchema format:\n\n<tools>\n"
        '<tool>{"name": "get_weather", "description": "Current weather.", "parameters": '
        '{"type": "object", "properties": {"location": {"type": "string"}}}}</tool>\n'
        '<tool>{"name": "book", "description": "Book <seats> for “guests”.", "parameters": '
        '{"type": "object", "properties": {"guests": {"type": "array"}}}}</tool>\n'
        "</tools>\n\n"
        "When you call tools, put every invocation in a single ]<]minimax[>[<tool_call> ... "
        ']<]minimax[>[</tool_call> block with one ]<]minimax[>[<invoke name="..."> line per '
        "call and one child element per parameter; expand nested objects into child elements "
        "and arrays into repeated ]<]minimax[>[<item> elements. For example:\n"
        "]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="get_weather">]<]minimax[>[<location>Paris'
        "]<]minimax[>[</location>]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>[e~[\n"
        "]~b]user\nWeather in Beijing, then book for Ada and Bo.[e~[\n"
        "]~b]ai\n</mm:think>On it.]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="get_weather">'
        "]<]minimax[>[<location>Beijing]<]minimax[>[</location>"
        "]<]minimax[>[<options>"
        "]<]minimax[>[<unit>celsius]<]minimax[>[</unit>"
        "]<]minimax[>[<days>2]<]minimax[>[</days>"
        "]<]minimax[>[<hourly>false]<]minimax[>[</hourly>"
        "]<]minimax[>[</options>"
        "]<]minimax[>[</invoke>\n"
        ']<]minimax[>[<invoke name="book">'
        "]<]minimax[>[<guests>"
        "]<]minimax[>[<item>]<]minimax[>[<name>Ada]<]minimax[>[</name>"
        "]<]minimax[>[<age>36]<]minimax[>[</age>]<]minimax[>[</item>"
        "]<]minimax[>[<item>]<]minimax[>[<name>Bo]<]minimax[>[</name>"
        "]<]minimax[>[<vip>true]<]minimax[>[</vip>]<]minimax[>[</item>"
        "]<]minimax[>[</guests>"
        "]<]minimax[>[<tags>"
        "]<]minimax[>[<item>]<]minimax[>[<item>a]<]minimax[>[</item>"
        "]<]minimax[>[<item>b]<]minimax[>[</item>]<]minimax[>[</item>"
        "]<]minimax[>[<item>]<]minimax[>[</item>"
        "]<]minimax[>[</tags>"
        "]<]minimax[>[<price>12.5]<]minimax[>[</price>"
        "]<]minimax[>[<note>null]<]minimax[>[</note>"
        "]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>[e~[\n"
        "]~b]tool\n"
        '<response>{"temp": 21}</response>\n'
        "<response>booked</response>[e~[\n"
        "]~b]ai\n<mm:think>"
    )
    assert rendered == expected


def test_tool_only_assistant_turn_and_single_tool_result() -> None:
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "now", "arguments": {}}]},
        {"role": "tool", "content": "12:00"},
        {"role": "user", "content": "Thanks"},
    ]
    expected = (
        system_block("disabled")
        + DEFAULT_DEVELOPER
        + "]~b]user\nTime?[e~[\n"
        + f"]~b]ai\n</mm:think>{NS}<tool_call>\n"
        + f'{NS}<invoke name="now">{NS}</invoke>\n{NS}</tool_call>[e~[\n'
        + "]~b]tool\n<response>12:00</response>[e~[\n"
        + "]~b]user\nThanks[e~[\n"
        + "]~b]ai\n</mm:think>"
    )
    assert render_chat(TEMPLATE, messages, thinking_mode="disabled") == expected


def test_multimodal_content_parts() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "text", "text": " with "},
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                {"type": "video"},
            ],
        }
    ]
    expected = (
        system_block("adaptive")
        + DEFAULT_DEVELOPER
        + "]~b]user\nCompare ]<]image[>[ with ]<]image[>[ and ]<]video[>[]<]video[>[[e~[\n"
        + "]~b]ai\n"
    )
    assert render_chat(TEMPLATE, messages) == expected


def test_unknown_content_part_raises() -> None:
    messages = [{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}]
    with pytest.raises(ChatTemplateError, match="Unsupported content part type: audio_url"):
        render_chat(TEMPLATE, messages)


def test_render_does_not_mutate_messages() -> None:
    before = copy.deepcopy(TOOL_CONVERSATION)
    render_chat(TEMPLATE, TOOL_CONVERSATION)
    assert before == TOOL_CONVERSATION


def test_invalid_json_arguments_are_kept_as_text() -> None:
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{oops"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "g", "arguments": "[1]"}]},
    ]
    rendered = render_chat(TEMPLATE, messages, add_generation_prompt=False)
    assert f'{NS}<invoke name="f">{{oops{NS}</invoke>' in rendered
    assert f'{NS}<invoke name="g">[1]{NS}</invoke>' in rendered


def test_renderer_environment_matches_transformers() -> None:
    template = (
        "{{ data | tojson }}|{{ data | tojson(indent=1) }}|"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
        "{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|"
        "{{ strftime_now('%Y') | length }}"
    )
    data = {"z": "<é&>", "a": [1]}
    expected = '{"z": "<é&>", "a": [1]}|{\n "z": "<é&>",\n "a": [\n  1\n ]\n}|01|2|4'
    assert render_chat(template, [], data=data) == expected


def test_renderer_errors() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% if %}", [])
    with pytest.raises(ChatTemplateError, match=r"^custom failure$"):
        render_chat("{{ raise_exception('custom failure') }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append(1) }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{% set ns = namespace(_hidden=1) %}", [])


def test_load_chat_template(tmp_path: pathlib.Path) -> None:
    assert load_chat_template(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "from config"}))
    assert load_chat_template(tmp_path) == "from config"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "main"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path) == "main"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("from file")
    assert load_chat_template(tmp_path) == "from file"


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tokenizer_files(model_dir, 512)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert load_chat_template(model_dir) == TEMPLATE
    return tokenizer


def dict_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with JSON-string arguments parsed, as transformers needs them."""
    converted = copy.deepcopy(messages)
    for message in converted:
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if isinstance(function.get("arguments"), str):
                function["arguments"] = json.loads(function["arguments"])
    return converted


HF_CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    (HELLO, None, {}),
    (HELLO, None, {"thinking_mode": "enabled", "reasoning_effort": "xhigh"}),
    (HELLO, None, {"thinking_mode": "disabled", "reasoning_effort": "low"}),
    (TOOL_CONVERSATION, [WEATHER_TOOL, BOOK_TOOL], {"thinking_mode": "enabled"}),
    ([*TOOL_CONVERSATION, {"role": "user", "content": "日本語 ok?"}], None, {}),
    (
        [
            {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A cat."},
            {"role": "system", "content": "Late rule."},
            {"role": "user", "content": "Sure?"},
        ],
        [WEATHER_TOOL],
        {"thinking_mode": "adaptive", "reasoning_effort": "medium"},
    ),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("messages", "tools", "kwargs"), HF_CASES)
def test_matches_transformers_apply_chat_template(
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
) -> None:
    ours = render_chat(
        TEMPLATE, messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )
    theirs = hf_tokenizer.apply_chat_template(
        dict_arguments(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    assert ours == theirs
