"""What the scripted chat tests share: the scripted outputs (thinking traces, MiniMax tool-call
blocks), the tools they call, and helpers that cut text into pieces and read SSE events.
"""

from __future__ import annotations

from typing import Any

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
