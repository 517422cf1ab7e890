"""`stream_options.continuous_usage_stats` (vLLM's extension): with `include_usage`, every chunk
of a stream carries its choice's running usage, so a client can tell how many tokens each chunk
held; the stream still ends with the usage chunk; without the option nothing changes."""

from __future__ import annotations

import itertools
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
# One token per piece. The parser holds "<mm:" and "think>" back until the tag is complete, so
# some pieces make no chunk of their own: their tokens show in the next chunk's usage.
PIECES = ["<mm:", "think>", "I", " think", "</mm:", "think>", "\n\n", "Yes", "."]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def says(pieces: list[str]) -> Any:
    return lambda req: pieces


def running(events: list[dict[str, Any]], index: int = 0) -> list[int]:
    """completion_tokens of every chunk of choice `index`, in order (the final chunk not)."""
    return [
        e["usage"]["completion_tokens"]
        for e in events
        if e["choices"] and e["choices"][0]["index"] == index
    ]


async def test_chat_chunks_carry_running_usage_up_to_the_final_count(serve) -> None:
    async with serve(says(PIECES)) as s:
        events = await s.events(CHAT, {"messages": USER, "stream_options": CONTINUOUS})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(PIECES)
    assert all("usage" in e for e in chunks)
    counts = running(chunks)
    assert counts[0] == 0  # the role chunk: nothing generated yet
    assert counts == sorted(counts) and counts[-1] == len(PIECES)
    assert len(chunks) - 1 < len(PIECES)  # some pieces were held back...
    # ...and their tokens counted in a later chunk.
    assert max(b - a for a, b in itertools.pairwise(counts)) >= 2
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"] == 10
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_completion_chunks_count_each_choice_on_its_own(serve) -> None:
    request = {"prompt": "x", "n": 2, "stream_options": CONTINUOUS}
    async with serve(says(["a", "b", "c"])) as s:
        *chunks, final = await s.events(COMPLETIONS, request)
    assert running(chunks, 0) == running(chunks, 1) == [1, 2, 3]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6


async def test_without_the_option_only_the_final_chunk_has_usage(serve) -> None:
    async with serve(says(PIECES)) as s:
        plain = await s.events(CHAT, {"messages": USER, "stream_options": {"include_usage": True}})
        # As in vLLM, continuous_usage_stats alone (no include_usage) sends no usage at all.
        alone = await s.events(
            CHAT, {"messages": USER, "stream_options": {"continuous_usage_stats": True}}
        )
        text = await s.events(COMPLETIONS, {"prompt": "x", "stream_options": {}})
    assert all("usage" not in e for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"]
    assert all("usage" not in e for e in alone + text)
