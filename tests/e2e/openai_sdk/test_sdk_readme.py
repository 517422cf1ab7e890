"""The README's curl examples and the self-host guide's curl bodies, verbatim except for the
server address, key, model name and a small max_tokens.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from helpers.sdk_server import API_KEY, Server

from .sdk_cases import COOKBOOK_MAX_TOKENS

# ---------------------------------------------------------------------- README / self-host curl


def test_readme_curl_health_check(server: Server) -> None:
    # curl --fail --silent --show-error http://127.0.0.1:30000/health
    response = httpx.get(f"{server.url}/health")
    response.raise_for_status()
    assert response.json() == {"status": "ok"}


# The README's chat example (the self-host guide's "verify thinking control" body, max_tokens 64).
README_CURL_CHAT = """{
    "model": "MiniMaxAI/MiniMax-M3.1-Flash",
    "messages": [{"role": "user", "content": "How many prime numbers are there below 50?"}],
    "thinking": {"type": "disabled"},
    "temperature": 1.0,
    "top_p": 0.95,
    "max_tokens": 64
  }"""

# The self-host guide's "verify text generation" body (max_tokens 4096, cut below).
SELF_HOST_CURL_TEXT = """{
    "model": "MiniMaxAI/MiniMax-M3.1-Flash",
    "messages": [
      {"role": "user", "content": "Explain sparse attention in one sentence."}
    ],
    "temperature": 1.0,
    "top_p": 0.95,
    "max_tokens": 4096
  }"""


def curl_chat(server: Server, body: str) -> dict[str, Any]:
    # curl http://127.0.0.1:30000/v1/chat/completions -H "Content-Type: application/json" -d ...
    # plus the API key this server requires (the model name is not checked).
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    if choice["finish_reason"] == "length":
        assert data["usage"]["completion_tokens"] == json.loads(body)["max_tokens"]
    return data


def test_readme_curl_chat_completion_with_thinking_disabled(server: Server) -> None:
    data = curl_chat(server, README_CURL_CHAT)
    message = data["choices"][0]["message"]
    # The guide: "an empty or null choices[0].message.reasoning_content".
    assert message.get("reasoning_content") in (None, "")


def test_self_host_curl_text_generation(server: Server) -> None:
    body = SELF_HOST_CURL_TEXT.replace('"max_tokens": 4096', f'"max_tokens": {COOKBOOK_MAX_TOKENS}')
    assert body != SELF_HOST_CURL_TEXT
    data = curl_chat(server, body)
    assert data["usage"]["completion_tokens"] <= COOKBOOK_MAX_TOKENS
