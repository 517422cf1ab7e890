"""The official `openai` SDK (and plain httpx, for what the SDK hides) against a live
`m3serve serve`: real uvicorn, the multi-process engine, API key, both MiniMax parsers and a
64 KiB body limit, on the tiny random checkpoint.

The tiny model writes gibberish, so tests pin down shapes, types, usage arithmetic and
stream/non-stream agreement at temperature 0 — never meaning. The SGLang cookbook's Python
examples (§3.1-3.3), the README's curl examples and the self-host guide's curl bodies run
verbatim except for the server address, key, model name and a small max_tokens.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers.metrics_text import samples
from helpers.sdk_server import (
    API_KEY,
    MAX_REQUEST_BYTES,
    Server,
    bearer_client,
    sdk_client,
    start_server,
)
from helpers.serve_process import descendants

SMALL = 12  # max_tokens for most requests: enough text to compare, cheap on CPU

PROMPT = [{"role": "user", "content": "What is 15% of 240? Explain briefly."}]
GREEDY = {"temperature": 0, "max_tokens": SMALL}


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(model_path, tmp_path_factory.mktemp("serve") / "server.log")
    family = descendants(running.proc.pid)
    yield running
    survivors = running.stop()
    assert running.proc.returncode is not None
    assert len(family) >= 2, f"expected engine + tokenizer processes, found {family}"
    assert survivors == [], f"processes left behind: {survivors}\n{running.log_tail()}"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with sdk_client(server) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with bearer_client(server) as plain:
        yield plain


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


# ---------------------------------------------------------------------- errors


def test_wrong_api_key_raises_authentication_error(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.models.list()
        assert caught.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=server.model, messages=PROMPT, max_tokens=1)


def test_missing_api_key_is_401_in_openai_error_shape(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": PROMPT})
    assert_openai_error(response, 401)
    assert response.json()["error"]["type"] == "authentication_error"
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401)


def test_health_needs_no_api_key(server: Server) -> None:
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', None),
        (b"not json at all", None),
        (b"", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', None),
    ],
    ids=[
        "truncated",
        "not-json",
        "empty",
        "temperature-str",
        "max-tokens-str",
        "messages-str",
        "role",
    ],
)
def test_malformed_json_and_wrong_types_are_400_in_openai_error_shape(
    http: httpx.Client, body: bytes, param: str | None
) -> None:
    response = http.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, 400, param)
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_empty_messages_raise_bad_request(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=server.model, messages=[], max_tokens=1)
    assert caught.value.body["param"] == "messages"


def test_max_tokens_beyond_the_context_raise_bad_request(
    client: openai.OpenAI, server: Server
) -> None:
    context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, server, max_tokens=context + 1)
    assert "context length" in caught.value.body["message"]


def test_body_over_the_request_limit_is_413(client: openai.OpenAI, server: Server) -> None:
    huge = [{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=server.model, messages=huge, max_tokens=1)
    assert caught.value.status_code == 413
    assert str(MAX_REQUEST_BYTES) in caught.value.body["message"]


def test_body_just_under_the_limit_is_served(client: openai.OpenAI, server: Server) -> None:
    # The limit is on bytes: padding in an ignored field brings the body close to it.
    padding = "x" * (MAX_REQUEST_BYTES - 1024)
    response = chat(client, server, max_tokens=1, extra_body={"padding": padding})
    assert response.usage.completion_tokens == 1


def test_unknown_request_fields_are_ignored(client: openai.OpenAI, server: Server) -> None:
    response = chat(
        client,
        server,
        extra_body={"frobnicate": True, "vendor_options": {"x": [1, 2]}, "metadata": None},
    )
    plain = chat(client, server)
    assert response.choices[0].message.content == plain.choices[0].message.content


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

COOKBOOK_MAX_TOKENS = 16


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


# ---------------------------------------------------------------------- shutdown


def test_ctrl_c_shuts_the_server_down_cleanly(
    model_path: Path, tmp_path: Path, server: Server
) -> None:
    """SIGINT (Ctrl-C) stops uvicorn and the engine, leaves no process behind and prints no
    traceback. Its own server, so the module's server stays up for the other tests."""
    own = start_server(model_path, tmp_path / "server.log")
    family = descendants(own.proc.pid)
    assert len(family) >= 2
    assert httpx.get(f"{own.url}/health").status_code == 200
    survivors = own.stop()
    log = own.log_tail()
    assert survivors == []
    assert "Application shutdown complete" in log
    assert own.proc.returncode in (0, -signal.SIGINT, 128 + signal.SIGINT)
    assert "Traceback" not in log, log[log.find("Traceback") :][-1500:]
