"""/v1/chat/completions over HTTP with scripted model output: the <mm:think> trace parsed into
reasoning_content (streamed and not, however the text is cut into pieces) for each thinking
mode.
"""

from __future__ import annotations

import pytest

from .chat_scripts import CHAT, SIZES, THOUGHT, chat, finishes, positions, says, streamed

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
