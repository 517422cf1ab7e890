"""Engine behaviour that depends on KV memory: overlap on/off with tiny prefill chunks,
retraction under a pool too small for the running requests, eviction, and every page coming
back after a workload with aborts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers.hf_oracle import random_prompt

from m3serve import Engine
from m3serve.actors.scheduler import SchedulerActor
from m3serve.core.scheduler import Scheduler
from m3serve.model.generate import generate
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec

SPEC = TinySpec(dtype="float32", seed=1)
GREEDY = {"temperature": 0.0}
VOCAB = SPEC.vocab_size - 64


def scheduler_of(engine: Engine) -> Scheduler:
    actor = next(a for a in engine.async_engine.actors if isinstance(a, SchedulerActor))
    assert actor.core is not None
    return actor.core.scheduler


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_batch_invariance_with_small_prefill_chunks(
    model_path: Path, model: M3ForCausalLM, overlap: bool
) -> None:
    prompts = [random_prompt(200 + i, 5 + 4 * i, VOCAB) for i in range(16)]
    with Engine(
        str(model_path),
        single_process=True,
        chunked_prefill_size=6,
        disable_overlap_schedule=not overlap,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == generate(model, ids, 10)


def test_requests_outgrowing_the_pool_are_retracted_and_complete(
    model_path: Path, model: M3ForCausalLM
) -> None:
    prompts = [random_prompt(300 + i, 12, VOCAB) for i in range(8)]
    with Engine(
        str(model_path),
        single_process=True,
        max_total_tokens=160,  # 8 requests x (12 + 24) tokens = 288 > 160
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
        assert scheduler_of(engine).retracted > 0
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == generate(model, ids, 24)


def test_seeded_sampling_survives_retraction(model_path: Path) -> None:
    prompts = [random_prompt(600 + i, 12, VOCAB) for i in range(8)]
    params = [
        {
            "temperature": 0.9,
            "top_k": 50,
            "seed": 7 + i,
            "max_new_tokens": 24,
            "frequency_penalty": 0.4,
        }
        for i in range(8)
    ]
    with Engine(str(model_path), single_process=True) as roomy:
        expected = roomy.generate(input_ids=prompts, sampling_params=params)
    with Engine(
        str(model_path),
        single_process=True,
        max_total_tokens=160,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    ) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=params)
        assert scheduler_of(tight).retracted > 0
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected]


def test_eviction_under_a_small_pool_gives_correct_results(
    model_path: Path, model: M3ForCausalLM
) -> None:
    shared = random_prompt(400, 20, VOCAB)
    prompts = [[*shared, *random_prompt(410 + i, 10, VOCAB)] for i in range(10)]
    with Engine(str(model_path), single_process=True, max_total_tokens=128) as engine:
        for ids in prompts:
            out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 8})
            assert out["output_ids"] == generate(model, ids, 8)
        assert scheduler_of(engine).cache.tree.cached_pages > 0


def test_pages_return_to_the_baseline_after_finishes_and_aborts(model_path: Path) -> None:
    rng = random.Random(5)
    with Engine(str(model_path), single_process=True, max_total_tokens=1024) as engine:
        sched = scheduler_of(engine)
        baseline = sched.pool.num_free
        for round_ in range(3):
            prompts = [
                random_prompt(500 + 10 * round_ + i, rng.randint(3, 40), VOCAB) for i in range(8)
            ]
            streams = [
                engine.generate(
                    input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 30}, stream=True
                )
                for p in prompts[:3]
            ]
            for stream in streams:  # abort these after a couple of chunks
                next(stream)
                next(stream)
                stream.close()
            engine.generate(input_ids=prompts[3:], sampling_params={**GREEDY, "max_new_tokens": 20})
        engine.generate("drain", {**GREEDY, "max_new_tokens": 1})  # aborts land before this ends
        sched.idle_check()
        assert not sched.running and not sched.waiting
        assert sched.pool.num_free + sched.cache.tree.cached_pages == baseline
        sched.cache.reset()
        assert sched.pool.num_free == baseline
