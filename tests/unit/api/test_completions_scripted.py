"""/v1/completions over HTTP with a scripted engine: the four prompt forms, n per prompt,
echo, refusals, streaming and usage."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.scripted_engine import ScriptedEngine

from m3serve.runtime.config import ApiArgs, ServerArgs
from m3serve.runtime.messages import GenerateReq

COMPLETIONS = "/v1/completions"


def prompt_of(req: GenerateReq) -> str:
    if req.prompt is not None:
        return req.prompt
    assert req.input_ids is not None and req.input_ids.array is not None
    return ",".join(str(i) for i in req.input_ids.array.tolist())


def echo_prompt(req: GenerateReq) -> list[str]:
    """Answers `[<prompt>/<seed>]` in three pieces, so each choice shows what it was asked."""
    return ["[", f"{prompt_of(req)}/{req.sampling.seed}", "]"]


def texts(body: dict[str, Any]) -> list[str]:
    return [c["text"] for c in body["choices"]]


async def test_a_string_prompt_gets_one_choice(serve) -> None:
    async with serve(lambda req: ["Once", " upon", " a time"]) as s:
        response = await s.post(COMPLETIONS, {"prompt": "Tell me a story"})
        req = s.engine.seen[-1]
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": "Once upon a time",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert req.prompt == "Tell me a story"
    assert req.messages is None
    assert req.sampling.max_new_tokens == 16  # OpenAI's default for this endpoint
    assert req.sampling.skip_special_tokens is True
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_a_list_of_strings_gets_n_choices_per_prompt_prompt_major(serve) -> None:
    async with serve(echo_prompt) as s:
        body = (await s.post(COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "seed": 5})).json()
        seen = [(r.prompt, r.sampling.seed) for r in s.engine.seen]
    assert seen == [("a", 5), ("a", 6), ("b", 5), ("b", 6)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert texts(body) == ["[a/5]", "[a/6]", "[b/5]", "[b/6]"]
    # Each prompt's tokens count once, however many choices it has.
    assert body["usage"]["prompt_tokens"] == 2 * 10
    assert body["usage"]["completion_tokens"] == 4 * 3
    assert body["usage"]["total_tokens"] == 20 + 12


async def test_token_ids_are_one_prompt(serve) -> None:
    async with serve(echo_prompt) as s:
        body = (await s.post(COMPLETIONS, {"prompt": [5, 6, 7]})).json()
        (req,) = s.engine.seen
    assert req.prompt is None
    assert req.input_ids.count == 3
    assert texts(body) == ["[5,6,7/None]"]


async def test_a_list_of_id_lists_is_that_many_prompts(serve) -> None:
    async with serve(echo_prompt) as s:
        body = (await s.post(COMPLETIONS, {"prompt": [[1, 2], [3, 4, 5]], "n": 2})).json()
    assert texts(body) == ["[1,2/None]", "[1,2/None]", "[3,4,5/None]", "[3,4,5/None]"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "prompt",
    [["a", 1], ["a", [1, 2]], [1, [2]], "", [], [[1], []], ["a", ""]],
    ids=["str+int", "str+ids", "int+ids", "empty", "empty-list", "empty-ids", "empty-str"],
)
async def test_a_mixed_or_empty_prompt_is_a_400(serve, prompt) -> None:
    async with serve(echo_prompt) as s:
        response = await s.post(COMPLETIONS, {"prompt": prompt})
        assert s.engine.seen == []
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["type"] == "invalid_request_error"


async def test_echo_prepends_the_prompt_text(serve) -> None:
    async with serve(lambda req: [" world", "!"]) as s:
        body = (await s.post(COMPLETIONS, {"prompt": "Hello", "echo": True})).json()
        events = await s.events(COMPLETIONS, {"prompt": "Hello", "echo": True})
    assert texts(body) == ["Hello world!"]
    assert events[0]["choices"][0]["text"] == "Hello world"
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello world!"


async def test_echo_of_token_ids_decodes_them(serve) -> None:
    ids = [300, 301, 302]
    async with serve(lambda req: ["!"]) as s:
        prompt = (await s.post("/v1/detokenize", {"tokens": ids})).json()["prompt"]
        body = (await s.post(COMPLETIONS, {"prompt": [ids], "echo": True})).json()
    assert prompt
    assert texts(body) == [prompt + "!"]


async def test_suffix_is_refused(serve) -> None:
    async with serve(echo_prompt) as s:
        response = await s.post(COMPLETIONS, {"prompt": "def f(", "suffix": "return x"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("logprobs", [-1, 6, 100])
async def test_logprobs_out_of_range_is_a_400(serve, logprobs) -> None:
    async with serve(echo_prompt) as s:
        response = await s.post(COMPLETIONS, {"prompt": "x", "logprobs": logprobs})
        assert s.engine.seen == []
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("logprobs", [0, 5])
async def test_logprobs_in_range_are_asked_of_the_engine(serve, logprobs) -> None:
    async with serve(echo_prompt) as s:
        body = (await s.post(COMPLETIONS, {"prompt": "x", "logprobs": logprobs})).json()
        sampling = s.engine.seen[-1].sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, logprobs)
    assert set(body["choices"][0]["logprobs"]) == {
        "tokens",
        "token_logprobs",
        "top_logprobs",
        "text_offset",
    }


async def test_streaming_sends_one_chunk_per_piece_and_finishes_once(serve) -> None:
    pieces = ["Once", " upon", " a", " time"]
    async with serve(lambda req: pieces) as s:
        events = await s.events(COMPLETIONS, {"prompt": "Story:", "max_tokens": 4})
        assert s.engine.seen[-1].stream is True
        assert s.engine.seen[-1].sampling.max_new_tokens == 4
    assert [e["choices"][0]["text"] for e in events] == pieces
    assert all(e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "stop"]
    assert all("usage" not in e for e in events)


async def test_streaming_n_per_prompt_tags_chunks_with_choice_indexes(serve) -> None:
    async with serve(echo_prompt) as s:
        events = await s.events(COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "seed": 1})
    by_index: dict[int, str] = {}
    for e in events:
        (choice,) = e["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    assert by_index == {0: "[a/1]", 1: "[a/2]", 2: "[b/1]", 3: "[b/2]"}


async def test_include_usage_ends_the_stream_with_a_usage_chunk(serve) -> None:
    request = {"prompt": ["a", "b"], "n": 2, "stream_options": {"include_usage": True}}
    async with serve(echo_prompt) as s:
        events = await s.events(COMPLETIONS, request)
        whole = (await s.post(COMPLETIONS, {**request, "stream": False})).json()
    last = events[-1]
    assert last["choices"] == []
    assert last["usage"] == whole["usage"]
    assert last["usage"]["prompt_tokens"] == 20
    assert all("usage" not in e for e in events[:-1])


async def test_stop_and_sampling_fields_reach_the_engine(serve) -> None:
    request = {"prompt": "x", "stop": ["\n", "END"], "temperature": 0, "ignore_eos": True}
    async with serve(echo_prompt) as s:
        await s.post(COMPLETIONS, request)
        sampling = s.engine.seen[-1].sampling
    assert sampling.stop == ["\n", "END"]
    assert sampling.temperature == 0
    assert sampling.ignore_eos is True


@pytest.mark.parametrize(
    "prompt", [[2**31], [[1, 2**31]], [2**63]], ids=["int32+1", "in-list", "int64"]
)
async def test_token_ids_beyond_int32_are_a_400_not_a_crash(serve, prompt) -> None:
    async with serve(echo_prompt) as s:
        response = await s.post(COMPLETIONS, {"prompt": prompt})
        assert s.engine.seen == []
    assert response.status_code == 400, response.text
    # Beyond 64 bits the wire check names the element itself: prompt[0].
    assert response.json()["error"]["param"].startswith("prompt")


async def test_fan_out_beyond_max_fanout_is_a_400_before_any_request(serve) -> None:
    # n x prompts: one small body must not become thousands of engine requests.
    prompts = ["a"] * 9
    async with serve(echo_prompt, ApiArgs(max_fanout=16)) as s:
        refused = await s.post(COMPLETIONS, {"prompt": prompts, "n": 2})
        assert s.engine.seen == []
        served = await s.post(COMPLETIONS, {"prompt": prompts[:8], "n": 2})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "18 engine requests" in error["message"] and "--max-fanout" in error["message"]
    assert served.status_code == 200
    assert len(served.json()["choices"]) == 16


async def test_fan_out_counts_against_the_engines_queue(serve, model_dir) -> None:
    # The engine holds at most max_running + max_queued requests; a fan-out that would pass
    # that, beside the requests already in flight, is a 503 with Retry-After.
    args = ServerArgs.from_kwargs(max_running_requests=2, max_queued_requests=3)
    engine = ScriptedEngine(echo_prompt, str(model_dir), args=args)
    async with serve(engine) as s:
        engine.num_requests = 2  # two requests in flight elsewhere
        refused = await s.post(COMPLETIONS, {"prompt": ["a", "b"], "n": 2})
        assert engine.seen == []
        engine.num_requests = 1
        served = await s.post(COMPLETIONS, {"prompt": ["a", "b"], "n": 2})
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "--max-queued-requests" in refused.json()["error"]["message"]
    assert served.status_code == 200
