"""The warm-up pass launches every Triton kernel variant that later steps need.

The Hopper backend runs in Triton's interpreter with the kernels not executed: launch decisions
depend on shapes only, so the compile keys (Triton's own specialization rules, see
tests/helpers/triton_keys.py) are what the GPU would compile, at the cost of host work alone.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import M31_SPEC, QUANT_SPEC
from helpers.triton_keys import describe, recording

import m3serve.kernels.triton.attention as attention
from m3serve.backends.hopper import HopperBackend
from m3serve.core.warmup import WarmupLimits, shape_points, warmup_plans
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep, StepPlan

NUM_PAGES = 128


@pytest.fixture(scope="module", params=["fp32", "quantized"])
def model(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[TinySpec], Path]
) -> M3ForCausalLM:
    """The fp32 checkpoint, and the MXFP8/NVFP4 one (the quantized linears, the NVFP4 MoE
    and its sorting kernels)."""
    backend = HopperBackend(torch.device("cpu"), interpreter=True)
    spec, dtype = (M31_SPEC, "float32") if request.param == "fp32" else (QUANT_SPEC, "bfloat16")
    return load_model(tiny_checkpoint(spec), backend, dtype, progress=False).model


def _forward(model: M3ForCausalLM, kv: KVCache, plan: StepPlan) -> None:
    batch = ForwardBatch.build(plan.seqs, model.cfg.page_size, "cpu")
    with torch.inference_mode():
        model(batch, kv)


def _small_pass(model: M3ForCausalLM) -> tuple[WarmupLimits, KVCache]:
    """Limits whose pass covers every kind of step in 1500 plans, and a KV cache
    for them."""
    cfg = model.cfg
    limits = WarmupLimits(
        page_size=cfg.page_size,
        num_pages=NUM_PAGES,
        max_running=8,
        max_step_tokens=72,
        context=96 * cfg.page_size,
    )
    return limits, KVCache.allocate(cfg, NUM_PAGES + 1, model.dtype, torch.device("cpu"))


def _random_plan(rng: random.Random, limits: WarmupLimits) -> StepPlan:
    """A step the scheduler could plan: decodes and prefill chunks at random contexts."""
    page, budget = limits.page_size, limits.max_step_tokens
    seqs = []
    for slot in range(rng.randint(1, limits.max_running)):
        extend = 1 if rng.random() < 0.6 else rng.randint(1, max(budget // 2, 1))
        extend = min(extend, budget - len(seqs) - sum(s.extend for s in seqs) + len(seqs))
        if extend < 1:
            break
        start = rng.randint(0, limits.context - extend)
        count = -(-(start + extend) // page)
        pages = [(slot * count + i) % limits.num_pages for i in range(count)]
        seqs.append(SeqStep([1 + i % 256 for i in range(extend)], start, pages, slot))
        if sum(s.extend for s in seqs) >= budget:
            break
    return StepPlan(step=0, seqs=seqs)


def test_shape_points_cover_every_power_of_two_class() -> None:
    points = shape_points(1000)
    assert points[:17] == list(range(1, 18))
    assert {63, 64, 65, 511, 512, 513, 1000} <= set(points)
    above = points[16:]
    # The 1.25x grid, rounded down to ints.
    assert max(b / a for a, b in itertools.pairwise(above)) < 1.26


@pytest.mark.parametrize("context", [40, 4096])
def test_every_warmup_plan_is_a_valid_step(context: int) -> None:
    """Also when a step can carry more tokens than the context holds."""
    limits = WarmupLimits(16, 64, 4, max_step_tokens=200, context=context)
    for plan in warmup_plans(limits):
        for seq in plan.seqs:
            assert seq.start >= 0 and min(seq.pages) >= 0 and max(seq.pages) < limits.num_pages
        ForwardBatch.build(plan.seqs, limits.page_size, "cpu")


def test_random_steps_launch_no_variant_the_warmup_missed(
    model: M3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mixed steps split their decode rows off (AttentionConfig.mixed_decode_min_rows, off by
    # default) from 2 rows: the variants it launches must be warm too once it is on.
    split_early = replace(attention.DEFAULT_CONFIG, mixed_decode_min_rows=2)
    monkeypatch.setattr(attention, "DEFAULT_CONFIG", split_early)
    limits, kv = _small_pass(model)
    with recording(execute=False) as warm:
        for plan in warmup_plans(limits):
            _forward(model, kv, plan)
    rng = random.Random(0)
    with recording(execute=False) as traffic:
        for _ in range(300):
            _forward(model, kv, _random_plan(rng, limits))
    missed = traffic - warm
    assert not missed, f"{len(missed)} variants compile after warm-up:\n{describe(missed)}"


def test_the_plans_that_launched_a_new_variant_launch_every_variant_alone(
    model: M3ForCausalLM,
) -> None:
    """What a restart's warm-up record relies on (core/warmup_record.py): launch decisions
    follow each plan's shapes alone, so the plans after which a variant had launched that no
    plan before them did, run alone in a fresh pass, launch every variant the whole pass did."""
    limits, kv = _small_pass(model)
    needed: set[int] = set()
    plans = 0
    with recording(execute=False) as whole:
        for index, plan in enumerate(warmup_plans(limits)):
            before = len(whole)
            _forward(model, kv, plan)
            plans += 1
            if len(whole) > before:
                needed.add(index)
    with recording(execute=False) as alone:
        for index, plan in enumerate(warmup_plans(limits)):
            if index in needed:
                _forward(model, kv, plan)
    assert alone == whole, f"missed alone:\n{describe(whole - alone)}"
    assert len(needed) < plans / 4, f"{len(needed)} of {plans} plans"
