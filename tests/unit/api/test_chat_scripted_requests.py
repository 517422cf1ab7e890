"""/v1/chat/completions over HTTP with scripted model output: thinking controls, content parts
and sampling fields as they reach the engine, n choices, servers without parsers, and client
disconnects.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers.scripted_engine import ScriptedEngine

from m3serve.runtime.config import ApiArgs
from m3serve.runtime.messages import GenerateReq

from .chat_scripts import (
    CHAT,
    WEATHER,
    WEATHER_CALL,
    call_deltas,
    chat,
    chop,
    finishes,
    positions,
    says,
    streamed,
)

# ---------------------------------------------------------------------- thinking controls


@pytest.mark.parametrize(
    ("fields", "thinking", "effort"),
    [
        ({}, "adaptive", None),
        ({"thinking": {"type": "enabled"}}, "enabled", None),
        ({"thinking": {"type": "disabled"}}, "disabled", None),
        ({"reasoning_effort": "high"}, "adaptive", "high"),
        ({"thinking": {"type": "enabled"}, "reasoning_effort": "max"}, "enabled", "max"),
        ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, "disabled", None),
        ({"reasoning_effort": "none"}, "disabled", None),
        ({"thinking": {"type": "enabled"}, "reasoning_effort": "minimal"}, "disabled", None),
        ({"chat_template_kwargs": {"thinking_mode": "enabled"}}, "enabled", None),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "adaptive", "low"),
        (
            {
                "thinking": {"type": "disabled"},
                "chat_template_kwargs": {"thinking_mode": "enabled"},
            },
            "disabled",
            None,
        ),
    ],
)
async def test_thinking_controls_reach_the_engine_request(serve, fields, thinking, effort):
    async with serve(says("ok")) as s:
        response = await s.post(CHAT, chat(**fields))
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert (req.thinking, req.reasoning_effort) == (thinking, effort)
    assert req.chat_template_kwargs is None  # the thinking keys are taken out


async def test_other_chat_template_kwargs_pass_through(serve) -> None:
    kwargs = {"thinking_mode": "enabled", "reasoning_effort": "low", "custom_flag": [1, 2]}
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat(chat_template_kwargs=kwargs))
        req = s.engine.seen[-1]
    assert req.chat_template_kwargs == {"custom_flag": [1, 2]}
    assert (req.thinking, req.reasoning_effort) == ("enabled", "low")


@pytest.mark.parametrize(
    "fields",
    [
        {"thinking": {"type": "on"}},
        {"thinking": "enabled"},
        {"thinking": {"kind": "enabled"}},
        {"chat_template_kwargs": {"thinking_mode": "maybe"}},
    ],
)
async def test_an_invalid_thinking_mode_is_a_400_naming_thinking(serve, fields) -> None:
    async with serve(says("never")) as s:
        response = await s.post(CHAT, chat(**fields))
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "thinking"


async def test_an_invalid_reasoning_effort_is_a_400(serve) -> None:
    async with serve(says("never")) as s:
        response = await s.post(CHAT, chat(reasoning_effort="extreme"))
    assert response.status_code == 400
    assert "reasoning_effort" in response.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "video_url"])
async def test_media_content_parts_are_refused(serve, kind) -> None:
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": kind}],
    }
    async with serve(says("never")) as s:
        response = await s.post(CHAT, {"messages": [message]})
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert kind in error["message"]
    assert error["param"] == "messages.0.content.1"


async def test_text_content_parts_are_accepted(serve) -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    async with serve(says("Hello.")) as s:
        response = await s.post(CHAT, {"messages": [message]})
        req = s.engine.seen[-1]
    assert response.status_code == 200
    assert req.messages == [message]


async def test_sampling_fields_reach_the_engine_request(serve) -> None:
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "stop": "END",
        "seed": 11,
    }
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat(**fields))
        sampling = s.engine.seen[-1].sampling
    assert sampling.temperature == 0.5
    assert sampling.top_p == 0.9
    assert sampling.top_k == 20
    assert sampling.max_new_tokens == 7  # max_completion_tokens wins over max_tokens
    assert sampling.stop == ["END"]
    assert sampling.seed == 11
    assert sampling.skip_special_tokens is False  # the parsers need the tags


async def test_unset_sampling_fields_take_the_checkpoint_defaults(serve) -> None:
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat())
        sampling = s.engine.seen[-1].sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 0.95)  # generation_config.json


async def test_max_completion_tokens_zero_is_refused_not_ignored(serve) -> None:
    # max_tokens=0 is a 400; max_completion_tokens=0 must not silently mean "no limit".
    async with serve(says("ok")) as s:
        response = await s.post(CHAT, chat(max_completion_tokens=0))
        unbounded = [r.sampling.max_new_tokens for r in s.engine.seen]
    assert unbounded == []
    assert response.status_code == 400


# ---------------------------------------------------------------------- n choices, logprobs


async def test_n_choices_have_indexes_and_seeds_in_order(serve) -> None:
    def script(req: GenerateReq) -> list[str]:
        return chop(f"<mm:think>r{req.sampling.seed}</mm:think>answer {req.sampling.seed}", 3)

    async with serve(script) as s:
        body = (await s.post(CHAT, chat(n=3, seed=40))).json()
        rids = [r.rid for r in s.engine.seen]
    assert len(set(rids)) == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [
        "answer 40",
        "answer 41",
        "answer 42",
    ]
    assert [c["message"]["reasoning_content"] for c in body["choices"]] == ["r40", "r41", "r42"]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * len(
        chop("<mm:think>r40</mm:think>answer 40", 3)
    )


async def test_n_streamed_choices_each_open_and_finish(serve) -> None:
    def script(req: GenerateReq) -> list[str]:
        return chop(f"answer {req.sampling.seed}", 2)

    async with serve(script) as s:
        events = await s.events(CHAT, chat(n=3, seed=0))
    roles = [c["index"] for e in events for c in e["choices"] if "role" in c["delta"]]
    assert roles == [0, 1, 2]
    for index in range(3):
        assert streamed(events, "content", index) == f"answer {index}"
        assert finishes(events, index) == ["stop"]
    assert all(c["logprobs"] is None for e in events for c in e["choices"])
    assert all(len(e["choices"]) == 1 for e in events)


async def test_logprobs_are_requested_from_the_engine_only_when_asked(serve) -> None:
    async with serve(says("ok")) as s:
        await s.post(CHAT, chat())
        plain = s.engine.seen[-1].sampling
        body = (await s.post(CHAT, chat(logprobs=True, top_logprobs=3))).json()
        asked = s.engine.seen[-1].sampling
    assert (plain.logprobs, plain.top_logprobs) == (False, 0)
    assert (asked.logprobs, asked.top_logprobs) == (True, 3)
    assert body["choices"][0]["logprobs"] == {"content": []}


# ---------------------------------------------------------------------- no parsers


async def test_without_parsers_the_raw_text_is_the_content(serve) -> None:
    text = "I think\n</mm:think>\n\nThe answer is 36.\n" + WEATHER_CALL
    async with serve(says(text, 3), ApiArgs()) as s:
        body = (await s.post(CHAT, chat(tools=[WEATHER], thinking={"type": "enabled"}))).json()
        sampling = s.engine.seen[-1].sampling
        events = await s.events(CHAT, chat(tools=[WEATHER]))
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"
    assert "completion_tokens_details" not in body["usage"]
    assert sampling.skip_special_tokens is True
    assert streamed(events, "content") == text
    assert call_deltas(events) == []
    assert positions(events, "reasoning_content") == []


# ---------------------------------------------------------------------- disconnects


async def test_closing_a_stream_early_ends_the_engine_stream(serve, model_dir) -> None:
    engine = ScriptedEngine(lambda req: ["tick "] * 200, str(model_dir), delay_s=0.01)
    async with serve(engine, streaming=True) as s:
        async with s.client.stream("POST", CHAT, json=chat(stream=True)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == [engine.seen[-1].rid]
        metrics = (await s.client.get("/metrics")).text
    assert "m3serve:request_aborted_total 1" in metrics


async def test_a_client_leaving_before_a_full_response_aborts_the_request(serve, model_dir) -> None:
    engine = ScriptedEngine(lambda req: ["tick "] * 200, str(model_dir), delay_s=0.01)
    async with serve(engine, streaming=True) as s:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.post(CHAT, chat(n=2)), timeout=0.2)
        assert sorted(engine.aborted) == sorted(r.rid for r in engine.seen)
        assert len(engine.aborted) == 2
        metrics = (await s.client.get("/metrics")).text
    assert "m3serve:request_aborted_total 1" in metrics
