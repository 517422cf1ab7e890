"""What the openai SDK tests share: the prompt, greedy settings, one chat call and the check of
OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from helpers.sdk_server import Server

SMALL = 12  # max_tokens for most requests: enough text to compare, cheap on CPU

PROMPT = [{"role": "user", "content": "What is 15% of 240? Explain briefly."}]
GREEDY = {"temperature": 0, "max_tokens": SMALL}
# max_tokens in place of the cookbook's and the guides' (the tiny model on CPU).
COOKBOOK_MAX_TOKENS = 16


def chat(client: openai.OpenAI, server: Server, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=server.model, **{"messages": PROMPT, **GREEDY, **kwargs}
    )


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param
