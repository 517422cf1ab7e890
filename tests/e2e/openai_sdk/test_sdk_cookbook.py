"""The SGLang cookbook's Python examples (§3.1-3.3) verbatim against a live server, except for
the server address, key, model name and a small max_tokens; and named tool_choice.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest
from helpers.sdk_server import API_KEY, Server

from .sdk_cases import COOKBOOK_MAX_TOKENS, chat

# ---------------------------------------------------------------------- the cookbook's examples

# SGLang MiniMax-M3.1 cookbook §3.1-3.3, verbatim. `run_cookbook` swaps in this server's address,
# key and model id, and a small max_tokens (the tiny model on CPU).

COOKBOOK_REASONING = """
from openai import OpenAI

client = OpenAI(base_url="http://localhost:30000/v1", api_key="EMPTY")

response = client.chat.completions.create(
    model="MiniMaxAI/MiniMax-M3.1-Flash",
    messages=[{"role": "user", "content": "What is 15% of 240? Explain briefly."}],
    max_tokens=4096,
)

message = response.choices[0].message
print("=============== Reasoning ===============")
print(message.reasoning_content)
print("=============== Answer ==================")
print(message.content)
"""

COOKBOOK_STREAMING_REASONING = """
response = client.chat.completions.create(
    model="MiniMaxAI/MiniMax-M3.1-Flash",
    messages=[{"role": "user", "content": "Solve step by step: what is 15% of 240?"}],
    max_tokens=4096,
    stream=True,
)

for chunk in response:
    if not chunk.choices:
        continue
    delta = chunk.choices[0].delta
    if getattr(delta, "reasoning_content", None):
        print(delta.reasoning_content, end="", flush=True)  # thinking stream
    if delta.content:
        print(delta.content, end="", flush=True)  # answer stream
print()
"""

COOKBOOK_THINKING = """
from openai import OpenAI

client = OpenAI(base_url="http://localhost:30000/v1", api_key="EMPTY")
question = [{"role": "user", "content": "How many prime numbers are there below 50?"}]

for label, extra in [
    ("thinking disabled", {"thinking": {"type": "disabled"}}),
    ("adaptive, effort low", {"thinking": {"type": "adaptive"}, "reasoning_effort": "low"}),
    ("enabled, effort max", {"thinking": {"type": "enabled"}, "reasoning_effort": "max"}),
]:
    response = client.chat.completions.create(
        model="MiniMaxAI/MiniMax-M3.1-Flash",
        messages=question,
        max_tokens=8192,
        extra_body=extra,
    )
    message = response.choices[0].message
    reasoning_chars = len(message.reasoning_content or "")
    print(f"[{label}] reasoning chars: {reasoning_chars}")
    print(f"  answer: {message.content.strip()}")
"""

COOKBOOK_TOOLS = """
from openai import OpenAI

client = OpenAI(base_url="http://localhost:30000/v1", api_key="EMPTY")

tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]

response = client.chat.completions.create(
    model="MiniMaxAI/MiniMax-M3.1-Flash",
    messages=[{"role": "user", "content": "What's the weather in Beijing?"}],
    tools=tools,
)

message = response.choices[0].message
if message.tool_calls:
    for call in message.tool_calls:
        print(f"Tool: {call.function.name}")
        print(f"Args: {call.function.arguments}")
"""


def run_cookbook(code: str, server: Server, namespace: dict[str, Any] | None = None) -> dict:
    """Exec a cookbook example against `server`; returns its variables."""
    swaps = {
        '"http://localhost:30000/v1"': repr(f"{server.url}/v1"),
        'api_key="EMPTY"': f"api_key={API_KEY!r}, max_retries=0",
        '"MiniMaxAI/MiniMax-M3.1-Flash"': repr(server.model),
        "max_tokens=4096": f"max_tokens={COOKBOOK_MAX_TOKENS}",
        "max_tokens=8192": f"max_tokens={COOKBOOK_MAX_TOKENS}",
        # The tool example sets no max_tokens; the tiny model would run to the context limit.
        "    tools=tools,\n)": f"    tools=tools,\n    max_tokens={COOKBOOK_MAX_TOKENS},\n)",
    }
    for old, new in swaps.items():
        code = code.replace(old, new)
    assert "localhost:30000" not in code and "MiniMaxAI/" not in code
    assert f"max_tokens={COOKBOOK_MAX_TOKENS}" in code
    variables: dict[str, Any] = dict(namespace or {})
    exec(compile(code, "<cookbook>", "exec"), variables)
    return variables


def test_cookbook_reasoning_example_runs(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    done = run_cookbook(COOKBOOK_REASONING, server)
    out = capsys.readouterr().out
    message = done["message"]
    assert isinstance(message.content, str)
    assert message.reasoning_content is None or isinstance(message.reasoning_content, str)
    assert out == (
        "=============== Reasoning ===============\n"
        f"{message.reasoning_content}\n"
        "=============== Answer ==================\n"
        f"{message.content}\n"
    )
    usage = done["response"].usage
    assert usage.completion_tokens <= COOKBOOK_MAX_TOKENS
    assert usage.completion_tokens_details.reasoning_tokens <= usage.completion_tokens

    streamed = run_cookbook(COOKBOOK_STREAMING_REASONING, server, {"client": done["client"]})
    out = capsys.readouterr().out
    assert out.endswith("\n")
    last = streamed["chunk"]
    assert last.object == "chat.completion.chunk"
    assert last.choices[0].finish_reason in ("stop", "length")


def test_cookbook_thinking_mode_and_effort_loop_runs(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    done = run_cookbook(COOKBOOK_THINKING, server)
    lines = capsys.readouterr().out.splitlines()
    labels = [re.match(r"\[(.+)\] reasoning chars: (\d+)$", line) for line in lines if "]" in line]
    labels = [m for m in labels if m]
    assert [m.group(1) for m in labels] == [
        "thinking disabled",
        "adaptive, effort low",
        "enabled, effort max",
    ]
    assert labels[0].group(2) == "0"  # disabled: no reasoning trace
    assert sum(line.startswith("  answer: ") for line in lines) == 3
    last = done["response"]  # the "enabled, effort max" turn
    assert last.choices[0].finish_reason in ("stop", "length")
    assert int(labels[2].group(2)) == len(last.choices[0].message.reasoning_content or "")


def test_cookbook_tool_calling_example_runs(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    done = run_cookbook(COOKBOOK_TOOLS, server)
    out = capsys.readouterr().out
    message = done["message"]
    calls = message.tool_calls or []
    assert out.count("Tool: ") == len(calls)
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments), dict)
    choice = done["response"].choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if not calls:
        assert isinstance(message.content, str)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a location",
        "parameters": {
            "type": "object",
            # Bounded, so that the random model's enforced call ends well inside the budget.
            "properties": {"location": {"type": "string", "maxLength": 12}},
            "required": ["location"],
        },
    },
}
# An enforced call is generated whole under the grammar; sampled, so a random model reaches
# its end (greedy may repeat one allowed token).
CALL_BUDGET = {"max_tokens": 200, "temperature": 1.0, "seed": 3}


def test_named_tool_choice_returns_a_call_of_that_tool(
    client: openai.OpenAI, server: Server
) -> None:
    response = chat(
        client,
        server,
        messages=[{"role": "user", "content": "What's the weather in Beijing?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **CALL_BUDGET,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_named_tool_choice_streams_the_call_header(client: openai.OpenAI, server: Server) -> None:
    """OpenAI streams a tool call's id, type and function name in its first delta; the SDK's
    accumulators (and every agent framework) rely on it."""
    request = {
        "messages": [{"role": "user", "content": "What's the weather in Beijing?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        **CALL_BUDGET,
    }
    (whole,) = chat(client, server, **request).choices[0].message.tool_calls
    deltas = [
        call
        for chunk in chat(client, server, stream=True, **request)
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas, "no tool_calls delta was streamed"
    first = deltas[0]
    assert first.index == 0
    assert first.id is not None and first.type == "function"
    assert first.function.name == whole.function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
