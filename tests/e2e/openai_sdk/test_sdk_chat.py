"""The official `openai` SDK (and plain httpx, for what the SDK hides) against a live server:
models, chat and completions (streamed and not), n, logprobs, seeds, tokenize and metrics.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers.metrics_text import samples
from helpers.sdk_server import Server

from .sdk_cases import SMALL, chat

# ---------------------------------------------------------------------- models, chat, completions


def test_models_list_returns_the_served_model(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by == "m3serve"


def test_chat_non_stream_returns_text_and_consistent_usage(
    client: openai.OpenAI, server: Server
) -> None:
    response = chat(client, server)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == server.model
    (choice,) = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= SMALL
    if choice.finish_reason == "length":
        assert usage.completion_tokens == SMALL
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached < usage.prompt_tokens


@pytest.mark.parametrize(
    "thinking", [None, "enabled"], ids=["adaptive-content", "enabled-reasoning"]
)
def test_chat_stream_reassembles_into_the_non_stream_message(
    client: openai.OpenAI, server: Server, thinking: str | None
) -> None:
    extra = {"thinking": {"type": thinking}} if thinking else {}
    chat(client, server, extra_body=extra)  # warm the prefix cache: cached_tokens match below
    whole = chat(client, server, extra_body=extra)
    stream = chat(
        client, server, extra_body=extra, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in with_choices
    )
    message = whole.choices[0].message
    assert content == message.content
    assert reasoning == (message.reasoning_content or "")
    if thinking == "enabled":
        assert reasoning, "with thinking enabled the output starts inside <mm:think>"

    (last,) = [c for c in chunks if c.usage is not None]
    assert last is chunks[-1] and last.choices == []
    assert last.usage.model_dump() == whole.usage.model_dump()


def test_completions_stream_agrees_with_non_stream_and_echo_prepends_the_prompt(
    client: openai.OpenAI, server: Server
) -> None:
    prompt = "The capital of France is"
    request = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": SMALL}
    whole = client.completions.create(**request)
    assert whole.object == "text_completion"
    (choice,) = whole.choices
    assert isinstance(choice.text, str)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    if choice.finish_reason == "length":
        assert whole.usage.completion_tokens == SMALL

    chunks = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason

    echoed = client.completions.create(**request, echo=True)
    assert echoed.choices[0].text == prompt + choice.text
    echoed_stream = list(client.completions.create(**request, echo=True, stream=True))
    assert echoed_stream[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in echoed_stream) == prompt + choice.text


@pytest.mark.parametrize("echo", [False, True])
def test_completions_logprob_offsets_run_on_across_stream_chunks(
    client: openai.OpenAI, server: Server, echo: bool
) -> None:
    prompt = "Sparse attention keeps"
    request = {
        "model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 8,
        "logprobs": 2, "echo": echo,
    }  # fmt: skip
    whole = client.completions.create(**request).choices[0].logprobs
    assert whole is not None and len(whole.tokens) > 1
    start = len(prompt) if echo else 0
    ends = [start + sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]
    assert whole.text_offset == ends

    streamed: list[int] = []
    for chunk in client.completions.create(**request, stream=True):
        piece = chunk.choices[0].logprobs
        streamed += piece.text_offset if piece is not None else []
    assert streamed == whole.text_offset


# ---------------------------------------------------------------------- n, logprobs, seed


def test_n_returns_that_many_choices(client: openai.OpenAI, server: Server) -> None:
    response = chat(client, server, n=2, max_tokens=6)
    assert [c.index for c in response.choices] == [0, 1]
    # Greedy decoding: both choices are the same text.
    assert response.choices[0].message.content == response.choices[1].message.content
    single = chat(client, server, max_tokens=6)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert response.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_logprobs_give_each_token_and_its_top_alternatives(
    client: openai.OpenAI, server: Server
) -> None:
    response = chat(client, server, logprobs=True, top_logprobs=2, max_tokens=6)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_seed_makes_sampled_output_reproducible(client: openai.OpenAI, server: Server) -> None:
    sampled = {"temperature": 1.0, "top_p": 1.0, "seed": 1234, "max_tokens": SMALL, "n": 2}
    first = chat(client, server, **sampled)
    second = chat(client, server, **sampled)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]


# ---------------------------------------------------------------------- tokenize, metrics


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Hello, world! Sparse attention in one sentence."
    tokenized = http.post("/v1/tokenize", json={"prompt": text})
    assert tokenized.status_code == 200
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert all(isinstance(t, int) for t in body["tokens"])
    detokenized = http.post("/v1/detokenize", json={"tokens": body["tokens"]})
    assert detokenized.status_code == 200
    assert detokenized.json() == {"prompt": text}


def test_metrics_are_prometheus_text_counting_requests(
    client: openai.OpenAI, server: Server, http: httpx.Client
) -> None:
    chat(client, server, max_tokens=2)
    chat(client, server, max_tokens=2, stream=True).close()
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found = samples(response.text)
    assert "# TYPE m3serve:request_total counter" in response.text
    ok_chats = found['m3serve:request_total{endpoint="/v1/chat/completions",status="200"}']
    assert ok_chats >= 2
    assert found["m3serve:num_running_reqs"] >= 0
    assert "m3serve:num_waiting_reqs" in found
