"""`m3serve.Engine` end to end on a tiny checkpoint, in both process modes: the same tests run
with every actor in this process and with ZeroMQ between actor processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.hf_oracle import hf_greedy, load_hf, random_prompt

from m3serve import Engine, RequestError
from m3serve.model.generate import generate
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec

SPEC = TinySpec(dtype="float32", seed=1)
MODES = ["single-process", "multi-process"]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module", params=MODES)
def engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[Engine]:
    with Engine(
        str(model_path),
        single_process=request.param == "single-process",
        max_total_tokens=8192,
        chunked_prefill_size=16,
    ) as eng:
        yield eng


def solo(model: M3ForCausalLM, ids: list[int], n: int) -> list[int]:
    return generate(model, ids, n)


def test_greedy_matches_the_model_loop_and_transformers(
    engine: Engine, model: M3ForCausalLM, model_path: Path
) -> None:
    hf = load_hf(model_path)
    for seed in (1, 2, 3):
        ids = random_prompt(seed, 30 + 7 * seed, SPEC.vocab_size - 64)
        out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 32})
        assert out["output_ids"] == solo(model, ids, 32) == hf_greedy(hf, ids, 32)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


def test_sixteen_requests_together_equal_each_alone(engine: Engine, model: M3ForCausalLM) -> None:
    prompts = [random_prompt(100 + i, 3 + 5 * i, SPEC.vocab_size - 64) for i in range(16)]
    params = {**GREEDY, "max_new_tokens": 12}
    together = engine.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, together, strict=True):
        assert out["output_ids"] == solo(model, ids, 12)


def test_text_prompt_round_trips_through_the_tokenizer(engine: Engine) -> None:
    out = engine.generate("The capital of France is", {**GREEDY, "max_new_tokens": 8})
    again = engine.generate("The capital of France is", {**GREEDY, "max_new_tokens": 8})
    assert out["text"] == again["text"] and len(out["output_ids"]) == 8
    assert out["meta_info"]["finish_reason"] == {"type": "length"}


def test_shared_prefix_reports_cached_tokens_and_same_tokens(
    engine: Engine, model: M3ForCausalLM
) -> None:
    prefix = random_prompt(7, 41, SPEC.vocab_size - 64)
    first = [*prefix, 11, 12]
    second = [*prefix, 13, 14, 15]
    params = {**GREEDY, "max_new_tokens": 6}
    engine.generate(input_ids=first, sampling_params=params)
    out = engine.generate(input_ids=second, sampling_params=params)
    whole_pages = (len(prefix) // SPEC.index_block_size) * SPEC.index_block_size
    assert out["meta_info"]["cached_tokens"] >= whole_pages
    assert out["output_ids"] == solo(model, second, 6)


def test_streaming_chunks_concatenate_to_the_full_result(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 10}
    full = engine.generate("stream this", params)
    chunks = list(engine.generate("stream this", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [i for c in chunks for i in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_async_generate_runs_inside_a_host_event_loop(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 6}
    expected = engine.generate("async", params)

    async def main() -> tuple[dict, list[dict]]:
        whole = await engine.async_generate("async", params)
        parts = [c async for c in await engine.async_generate("async", params, stream=True)]
        return whole, parts

    loop = asyncio.new_event_loop()
    whole, parts = loop.run_until_complete(main())
    assert not loop.is_closed()  # the engine never closes the caller's loop
    loop.close()
    assert whole["output_ids"] == expected["output_ids"]
    assert [i for c in parts for i in c["output_ids"]] == expected["output_ids"]


def test_stop_string_ends_the_text_before_it(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 24}
    text = engine.generate("find a stop", params)["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    out = engine.generate("find a stop", {**params, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_id_ends_generation(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 16}
    ids = engine.generate("stop token", params)["output_ids"]
    out = engine.generate("stop token", {**params, "stop_token_ids": [ids[4]]})
    assert out["output_ids"] == ids[: ids.index(ids[4]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[4]}


def test_seeded_sampling_is_reproducible_in_any_batch(engine: Engine) -> None:
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 10}
    alone = engine.generate("seeded", params)["output_ids"]
    mixed = engine.generate(
        ["other one", "seeded", "third"],
        [{"temperature": 0.7, "max_new_tokens": 10}, params, {**GREEDY, "max_new_tokens": 4}],
    )
    assert mixed[1]["output_ids"] == alone


def test_chat_renders_the_template(engine: Engine) -> None:
    out = engine.chat(
        [{"role": "user", "content": "hello"}],
        sampling_params={**GREEDY, "max_new_tokens": 4},
        thinking="disabled",
    )
    assert len(out["output_ids"]) == 4
    assert out["meta_info"]["prompt_tokens"] > 20  # system + developer blocks were rendered


def test_logprobs_come_back_for_each_output_token(engine: Engine) -> None:
    out = engine.generate(
        "logprobs", {**GREEDY, "max_new_tokens": 5}, return_logprob=True, top_logprobs_num=3
    )
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [token for _, token in pairs] == out["output_ids"]
    tops = out["meta_info"]["output_top_logprobs"]
    # Greedy: the chosen token is the most likely one.
    assert all(top[0][1] == token for top, token in zip(tops, out["output_ids"], strict=True))


def test_invalid_requests_raise_request_error(engine: Engine) -> None:
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1.0})
    with pytest.raises(RequestError, match="context length"):
        engine.generate("x", {"max_new_tokens": 10**7})
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 10**6])
    # The engine keeps serving after refusing.
    assert len(engine.generate("ok", {**GREEDY, "max_new_tokens": 2})["output_ids"]) == 2


def test_breaking_out_of_a_stream_aborts_the_request(engine: Engine) -> None:
    for i, _ in enumerate(engine.generate("long", {**GREEDY, "max_new_tokens": 500}, stream=True)):
        if i == 3:
            break
    assert len(engine.generate("after", {**GREEDY, "max_new_tokens": 3})["output_ids"]) == 3
