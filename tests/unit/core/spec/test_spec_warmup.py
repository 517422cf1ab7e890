"""With speculative decoding on, the warm-up (the plain plans and the spec ones, through
`SpecStep` as the engine core runs them) launches every Triton kernel variant that later verify,
mixed and sampled steps need: the target's at verify-row shapes and the draft attention's, split
and not.

As in tests/unit/core/test_warmup.py the Hopper backend runs in Triton's interpreter with the
kernels not executed, and the compile keys come from Triton's own specialization rules
(tests/helpers/triton_keys.py: constexprs, launch options, and the value classes of every
argument not in `do_not_specialize`). The interpreter never splits the draft attention
(`draft_num_splits` is 1 off a GPU), so here it splits as on a GPU of a few SMs: small batches
split, large ones do not, and both variants must be warmed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.triton_keys import describe, recording

import m3serve.kernels.triton.draft_attention as triton_draft
from m3serve.backends.hopper import HopperBackend
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.sampler import Sampler
from m3serve.core.spec.proposer import DSparkProposer
from m3serve.core.spec.settings import SpecSettings
from m3serve.core.spec.verify_step import SpecStep
from m3serve.core.spec.warmup import spec_max_step_tokens, spec_warmup_plans
from m3serve.core.step_runner import StepRunner
from m3serve.core.warmup import SAMPLED, WarmupLimits, distinct_layers, warmup_plans
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams, SeqStep, StepPlan

SPEC = TinySpec(dtype="float32", seed=23, dspark=True)
CPU = torch.device("cpu")
NUM_PAGES = 96
SLOTS = 6
FAKE_SMS = 4  # 2 programs per SM: fewer than 8 (request, KV head) pairs split


@pytest.fixture
def runner(
    tiny_checkpoint: Callable[[TinySpec], Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[StepRunner]:
    path = tiny_checkpoint(SPEC)
    backend = HopperBackend(CPU, interpreter=True)
    model = load_model(path, backend, "float32", progress=False).model
    cfg = model.cfg
    kv = KVCache.allocate(cfg, NUM_PAGES + 1, model.dtype, CPU)
    proposer = DSparkProposer.load(path, model, backend, NUM_PAGES + 1, cfg.page_size, model.dtype)
    gamma = proposer.draft.cfg.block_size
    sampler = Sampler(SLOTS, cfg.vocab_size, CPU)
    matchers = GrammarMatchers(cfg.vocab_size)
    runner = StepRunner(model, kv, cfg.page_size, sampler, matchers, {}, None)
    settings = SpecSettings(path, gamma, block_verification=False, accept_length_override=0)
    runner.spec = SpecStep(model, kv, proposer, settings, SLOTS)
    _split_as_on_a_gpu(monkeypatch)
    # Kernels that do not run leave their outputs as allocated: zeroed, the sampled paths'
    # draws see finite probabilities.
    monkeypatch.setattr(torch, "empty", torch.zeros)
    monkeypatch.setattr(torch, "empty_like", torch.zeros_like)
    yield runner


def _split_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    original = triton_draft.draft_num_splits
    monkeypatch.setattr(triton_draft, "sm_count", lambda index: FAKE_SMS)

    def on_a_gpu(batch: int, heads: int, units: int, device: torch.device, per_sm: int = 2) -> int:
        return original(batch, heads, units, torch.device("cuda", 0), per_sm)

    monkeypatch.setattr(triton_draft, "draft_num_splits", on_a_gpu)


def _limits(runner: StepRunner) -> WarmupLimits:
    assert runner.spec is not None
    page = runner.page_size
    plain = 40 + SLOTS  # a prefill budget and one token per slot
    most = spec_max_step_tokens(plain, SLOTS, runner.spec.gamma, NUM_PAGES * page)
    return WarmupLimits(page, NUM_PAGES, SLOTS, max_step_tokens=most, context=40 * page)


def _run(runner: StepRunner, plans: Iterator[StepPlan], layers: list[int] | None) -> int:
    """Each plan as the engine core's warm-up runs it: its slots' lengths at its rows' starts."""
    assert runner.spec is not None
    count = 0
    for plan in plans:
        runner.spec.lengths.place(plan.seqs)
        runner.run(plan, layers)
        count += 1
    return count


def _random_spec_plan(rng: random.Random, limits: WarmupLimits, gamma: int) -> StepPlan:
    """A step a spec scheduler could plan: verify rows, plain decodes (requests kept off
    speculation) and prefill chunks at random contexts, greedy and sampled."""
    page, budget, block = limits.page_size, limits.max_step_tokens, gamma + 1
    seqs, sampling, prompts, used = [], {}, {}, 0
    for slot in range(rng.randint(1, limits.max_running)):
        kind = rng.random()
        extend = block if kind < 0.5 else 1 if kind < 0.7 else rng.randint(1, budget // 2)
        if used + extend > budget:
            break
        used += extend
        start = rng.randint(1, limits.context - extend)
        count = -(-(start + extend) // page)
        pages = [(slot * count + i) % limits.num_pages for i in range(count)]
        ids = [1 + (slot + i) % 256 for i in range(extend)]
        if kind < 0.5:
            seqs.append(SeqStep(None, start, pages, slot, new_request=True, draft=gamma))
        else:
            seqs.append(SeqStep(ids, start, pages, slot, new_request=True))
        sampling[slot] = SamplingParams(temperature=0.0) if rng.random() < 0.5 else SAMPLED
        prompts[slot] = ids
    return StepPlan(step=1, seqs=seqs, sampling=sampling, prompt_ids=prompts)


def test_spec_plans_are_valid_verify_steps() -> None:
    gamma, limits = 7, WarmupLimits(4, 64, 6, max_step_tokens=88, context=160)
    plans = list(spec_warmup_plans(limits, gamma))
    assert plans
    for plan in plans:
        tokens = sum(seq.extend for seq in plan.seqs)
        assert tokens <= limits.max_step_tokens and len(plan.seqs) <= limits.max_running
        assert any(seq.draft == gamma for seq in plan.seqs)
        for seq in plan.seqs:
            assert seq.start >= (1 if seq.draft else 0)
            assert seq.start + seq.extend <= limits.context
            assert len(seq.pages) * limits.page_size >= seq.start + seq.extend
            assert min(seq.pages) >= 0 and max(seq.pages) < limits.num_pages


def test_spec_plans_stay_few() -> None:
    """Bounded like the plain plans: a few times as many, not a product of every grid."""
    limits = WarmupLimits(128, 4096, 32, max_step_tokens=8192 + 32 * 8, context=20000)
    plain = sum(1 for _ in warmup_plans(limits))
    spec = sum(1 for _ in spec_warmup_plans(limits, 7))
    assert 0 < spec < plain


def test_random_spec_steps_launch_no_variant_the_warmup_missed(runner: StepRunner) -> None:
    assert runner.spec is not None
    gamma, limits = runner.spec.gamma, _limits(runner)
    cfg = runner.model.cfg
    layers = distinct_layers(cfg.layer_types, cfg.mlp_layer_types)
    with recording(execute=False) as warm:
        plans = itertools.chain(warmup_plans(limits), spec_warmup_plans(limits, gamma))
        _run(runner, plans, layers)
    splits = {key[1][-1] for key in warm if key[0] == "_draft_attention_kernel"}
    assert splits == {("SPLIT", "True"), ("SPLIT", "False")}, "both draft-attention variants"
    rng = random.Random(0)
    with recording(execute=False) as traffic:
        _run(runner, (_random_spec_plan(rng, limits, gamma) for _ in range(80)), None)
    missed = traffic - warm
    assert not missed, f"{len(missed)} variants compile after warm-up:\n{describe(missed)}"
