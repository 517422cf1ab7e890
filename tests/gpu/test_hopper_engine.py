"""The engine on the Hopper backend reproduces the reference backend's greedy tokens on a tiny
checkpoint, with CUDA graphs on and off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.devices import CPU_REFERENCE
from helpers.greedy import engine_outputs, first_divergence
from helpers.hf_oracle import full_logits, random_prompt

from m3serve import Engine
from m3serve.model.build import load_model
from m3serve.model.tiny.checkpoint import TinySpec

SPEC = TinySpec(dtype="bfloat16", seed=1)
PROMPTS = [random_prompt(s, 20 + 9 * s, SPEC.vocab_size - 64) for s in range(1, 6)]
MATCHING_PREFIX = 8  # bf16 tokens that must equal the fp32 reference's before any drift


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


def outputs(path: Path, **kwargs: object) -> list[list[int]]:
    got, info = engine_outputs(path, PROMPTS, **kwargs)
    assert info["backend"] == kwargs.get("backend", info["backend"])
    return got


@pytest.fixture(scope="module")
def reference(path: Path) -> list[list[int]]:
    return outputs(path, backend="reference", device="cpu", dtype="float32")


def test_hopper_fp32_matches_the_reference_backend(path: Path, reference: list[list[int]]) -> None:
    got = outputs(path, backend="hopper", dtype="float32", disable_cuda_graph=True)
    assert got == reference, [first_divergence(g, r) for g, r in zip(got, reference, strict=True)]


def test_cuda_graphs_on_and_off_give_identical_tokens(path: Path) -> None:
    eager = outputs(path, backend="hopper", dtype="bfloat16", disable_cuda_graph=True)
    graphs = outputs(path, backend="hopper", dtype="bfloat16", cuda_graph_max_bs_decode=8)
    assert graphs == eager


def test_hopper_bf16_against_the_fp32_reference(path: Path, reference: list[list[int]]) -> None:
    """bf16 on a random tiny model drifts from fp32 after a while; report where each prompt
    first diverges and how close the fp32 model itself was to a tie there, and require the
    early tokens to agree."""
    got = outputs(path, backend="hopper", dtype="bfloat16")
    model = load_model(path, CPU_REFERENCE, "float32", progress=False).model
    report = []
    for prompt, ours, ref in zip(PROMPTS, got, reference, strict=True):
        at = first_divergence(ours, ref)
        if at is None:
            report.append(None)
            continue
        logits = full_logits(model, prompt + ref[:at])[-1]
        report.append((at, round(float(logits[ref[at]] - logits[ours[at]]), 4)))
    print("bf16 vs fp32 (first divergence, fp32 logit gap there):", report)
    assert all(item is None or item[0] >= MATCHING_PREFIX for item in report)


def test_fp8_kv_cache_stays_close_to_bf16(path: Path) -> None:
    bf16 = outputs(path, backend="hopper", dtype="bfloat16")
    fp8 = outputs(path, backend="hopper", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    divergences = [first_divergence(a, b) for a, b in zip(fp8, bf16, strict=True)]
    print("fp8 KV first divergence per prompt:", divergences)
    assert all(0 <= t < SPEC.vocab_size for out in fp8 for t in out)
    # The first token only depends on the prompt's KV; fp8 rounding should rarely flip it.
    assert sum(d is None or d > 0 for d in divergences) >= len(PROMPTS) // 2


def test_piecewise_prefill_graphs_on_and_off_give_identical_tokens(path: Path) -> None:
    off = outputs(path, backend="hopper", dtype="bfloat16", cuda_graph_backend_prefill="disabled")
    on = outputs(path, backend="hopper", dtype="bfloat16", cuda_graph_max_bs_prefill=256)
    assert on == off


def test_overlap_on_and_off_give_identical_tokens(path: Path) -> None:
    on = outputs(path, backend="hopper", dtype="bfloat16", launch_ahead="off")
    off = outputs(path, backend="hopper", dtype="bfloat16", disable_overlap_schedule=True)
    assert on == off


def test_steps_launched_ahead_give_the_tokens_of_steps_run_one_by_one(path: Path) -> None:
    """The default on a GPU (auto) launches ahead."""
    ahead = outputs(path, backend="hopper", dtype="bfloat16")
    serial = outputs(path, backend="hopper", dtype="bfloat16", disable_overlap_schedule=True)
    assert ahead == serial


def sampled_outputs(path: Path, **server_args: object) -> list[list[int]]:
    """Seeded top-p draws beside greedy rows and a penalized row, in one batch."""
    params = [
        {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_new_tokens": 24},
        {"temperature": 0.0, "max_new_tokens": 24},
        {"temperature": 0.8, "top_k": 20, "seed": 11, "max_new_tokens": 24},
        {"temperature": 1.0, "seed": 5, "frequency_penalty": 0.5, "max_new_tokens": 8},
        {"temperature": 1.0, "min_p": 0.05, "seed": 3, "max_new_tokens": 24},
    ]
    with Engine(
        str(path), single_process=True, max_total_tokens=65536, skip_warmup=True, **server_args
    ) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=params)
    return [r["output_ids"] for r in results]


def test_graphs_that_draw_their_rows_give_the_eager_draws(path: Path) -> None:
    """Decode graphs draw their rows' tokens themselves (core/graphs.py): seeded draws equal
    those of the eager sampler, step for step. While the penalized request runs its batch
    samples outside the graph; once it has ended the graph draws the other rows."""
    eager = sampled_outputs(path, backend="hopper", dtype="bfloat16", disable_cuda_graph=True)
    graphs = sampled_outputs(path, backend="hopper", dtype="bfloat16", cuda_graph_max_bs_decode=8)
    assert graphs == eager
    assert len({tuple(out) for out in graphs}) == len(graphs)


def test_steps_with_prompt_tokens_drawn_in_graphs_give_the_eager_draws(path: Path) -> None:
    """Steps with prompt tokens draw their sampled rows in the piecewise steps' head graphs
    (core/head_draw.py). Two slots for five requests: later prompts prefill beside running
    decodes (mixed steps); seeded draws equal the eager sampler's, step for step."""
    params = [
        {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_new_tokens": 16},
        {"temperature": 0.0, "max_new_tokens": 12},
        {"temperature": 0.8, "top_k": 20, "seed": 11, "max_new_tokens": 20},
        {"temperature": 1.0, "seed": 5, "max_new_tokens": 8},
        {"temperature": 1.0, "min_p": 0.05, "seed": 3, "max_new_tokens": 16},
    ]

    def run(**server_args: object) -> list[list[int]]:
        with Engine(
            str(path), single_process=True, max_total_tokens=65536, skip_warmup=True,
            max_running_requests=2, **server_args,
        ) as engine:  # fmt: skip
            results = engine.generate(input_ids=PROMPTS, sampling_params=params)
        return [r["output_ids"] for r in results]

    eager = run(disable_cuda_graph=True)
    graphs = run(cuda_graph_max_bs_decode=8)
    assert graphs == eager
    assert len({tuple(out) for out in graphs}) == len(graphs)
