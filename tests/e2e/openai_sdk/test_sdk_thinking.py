"""The thinking controls of the SGLang MiniMax-M3.1 cookbook through the `openai` SDK, and the
refusals of bad ones.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from helpers.sdk_server import Server

from .sdk_cases import chat

# ---------------------------------------------------------------------- thinking controls


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking": {"type": "disabled"}},
        {"thinking": {"type": "enabled"}, "reasoning_effort": "max"},
        {"thinking": {"type": "adaptive"}, "reasoning_effort": "low"},
    ],
    ids=["disabled", "enabled-max", "adaptive-low"],
)
def test_cookbook_thinking_controls_are_accepted(
    client: openai.OpenAI, server: Server, extra: dict[str, Any]
) -> None:
    response = chat(client, server, extra_body=extra)
    message = response.choices[0].message
    details = response.usage.completion_tokens_details
    assert isinstance(message.content, str)
    if extra["thinking"]["type"] == "disabled":
        assert message.reasoning_content in (None, "")
        assert details.reasoning_tokens == 0
    if extra["thinking"]["type"] == "enabled":
        # The prompt ends inside <mm:think>: the output is reasoning until </mm:think>.
        assert message.reasoning_content
        assert 1 <= details.reasoning_tokens <= response.usage.completion_tokens


@pytest.mark.parametrize("thinking", ["disabled", "adaptive"])
def test_reasoning_tokens_count_only_the_reasoning_the_parser_returns(
    client: openai.OpenAI, server: Server, thinking: str
) -> None:
    """A `</mm:think>` the model writes inside its answer is answer text (the reasoning parser's
    rule), so usage must not count the answer's tokens as reasoning. Ten seeded samples of the
    README's prompt: some of them write the tag mid-answer."""
    response = chat(
        client,
        server,
        messages=[{"role": "user", "content": "How many prime numbers are there below 50?"}],
        temperature=1.0,
        top_p=0.95,
        seed=0,
        n=10,
        max_tokens=64,
        extra_body={"thinking": {"type": thinking}},
    )
    reasoning = [c.message.reasoning_content or "" for c in response.choices]
    assert reasoning == [""] * 10, "no sample opens with <mm:think>: none has reasoning"
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_top_level_reasoning_effort_is_accepted(client: openai.OpenAI, server: Server) -> None:
    low = chat(client, server, reasoning_effort="low")
    default = chat(client, server)
    assert isinstance(low.choices[0].message.content, str)
    # The effort reaches the chat template, so the rendered prompt differs.
    assert low.usage.prompt_tokens != default.usage.prompt_tokens


def test_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI, server: Server) -> None:
    none = chat(client, server, extra_body={"reasoning_effort": "none"})
    disabled = chat(client, server, extra_body={"thinking": {"type": "disabled"}})
    assert none.usage.prompt_tokens == disabled.usage.prompt_tokens
    assert none.choices[0].message.content == disabled.choices[0].message.content


def test_unknown_thinking_type_is_a_bad_request_naming_thinking(
    client: openai.OpenAI, server: Server
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, server, extra_body={"thinking": {"type": "bogus"}})
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == "thinking"
    assert "thinking" in body["message"] and "bogus" in body["message"]


def test_unknown_reasoning_effort_is_a_bad_request(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, server, reasoning_effort="extreme")  # type: ignore[arg-type]
    assert "reasoning_effort" in str(caught.value.body)


def test_reasoning_effort_inside_chat_template_kwargs_is_honoured(
    client: openai.OpenAI, server: Server
) -> None:
    nested = chat(client, server, extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    top_level = chat(client, server, reasoning_effort="low")
    default = chat(client, server)
    assert nested.usage.prompt_tokens == top_level.usage.prompt_tokens
    assert nested.usage.prompt_tokens != default.usage.prompt_tokens
    assert nested.choices[0].message.content == top_level.choices[0].message.content
