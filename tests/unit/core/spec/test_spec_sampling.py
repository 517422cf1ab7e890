"""Sampled requests through speculative verify steps keep the target's distribution: the first
three tokens of many seeded requests (top-k 2: eight outcomes) fit the exact joint probability
the target gives them, with per-token rejection and with block verification. The draft is the
target without its top-k cut, so drafts are both kept and rejected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.kernels.sampling import filter_probs
from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams, SeqStep

from .agreeing import TargetProposer
from .markov import fit_p_value

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
PROMPT = [7, 8, 9, 10, 11]
TEMPERATURE, TOP_K, ROWS = 1.5, 2, 384
ALPHA = 1e-3  # the seeds are fixed, so a pass is a pass every run


def _next_probs(core: EngineCore, tokens: list[int]) -> torch.Tensor:
    """The target's sampling distribution [V] after `tokens`, computed apart from the engine."""
    cfg = core.model.cfg
    pages = -(-len(tokens) // cfg.page_size)
    kv = KVCache.allocate(cfg, pages, torch.float32, "cpu")
    batch = ForwardBatch.build([SeqStep(tokens, 0, list(range(pages)))], cfg.page_size, "cpu")
    probs = torch.softmax(core.model(batch, kv)[0] / TEMPERATURE, dim=-1)
    kept = filter_probs(probs, TOP_K, 1.0, 0.0)
    return kept / kept.sum()


def _exact_joint(core: EngineCore) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Every 3-token continuation the target can sample, and its probability."""
    first = _next_probs(core, PROMPT)
    outcomes, probs = [], []
    for a in first.nonzero().flatten().tolist():
        second = _next_probs(core, [*PROMPT, a])
        for b in second.nonzero().flatten().tolist():
            third = _next_probs(core, [*PROMPT, a, b])
            for c in third.nonzero().flatten().tolist():
                outcomes.append((a, b, c))
                probs.append(float(first[a] * second[b] * third[c]))
    return outcomes, torch.tensor(probs, dtype=torch.float64)


def _sample(core: EngineCore) -> tuple[list[tuple[int, ...]], list[int]]:
    sampling = [
        SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        for seed in range(ROWS)
    ]
    reqs = [Req(str(i), list(PROMPT), s, frozenset(), 0) for i, s in enumerate(sampling)]
    accepted: list[int] = []

    async def go() -> None:
        for req in reqs:
            core.add(req)
        while core.has_work:
            out = await core.step()
            for batch in out.batches.values() if out else ():
                accepted.extend(a for a in batch.spec_accepted if a)

    asyncio.run(go())
    return [tuple(req.output) for req in reqs], accepted


@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_sampled_verify_steps_keep_the_target_distribution(
    tiny_checkpoint: Callable[[TinySpec], Path], block: bool
) -> None:
    path = tiny_checkpoint(SPEC)
    args = ServerArgs.from_kwargs(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        max_total_tokens=8192,
        max_running_requests=ROWS,
        speculative_algorithm="DSPARK",
        speculative_use_block_verification=block,
    )
    core = EngineCore(args, path)
    try:
        assert core.spec is not None and core.spec.proposer is not None
        proposer = TargetProposer(core.model, core.kv, 7, core.spec.proposer.layer_ids)
        kv_dtype = core.kv.layers[0].k.dtype
        core.spec.attach(
            core.runner, core.model, core.backend, core.budget, kv_dtype, proposer=proposer
        )
        outcomes, probs = _exact_joint(core)
        assert abs(float(probs.sum()) - 1.0) < 1e-6
        samples, accepted = _sample(core)
    finally:
        core.close()
    index = {outcome: i for i, outcome in enumerate(outcomes)}
    assert all(s in index for s in samples), "a token outside the target's top-k came out"
    observed = torch.bincount(torch.tensor([index[s] for s in samples]), minlength=len(outcomes))
    assert fit_p_value(observed.double(), probs) > ALPHA
    # The test has teeth: some verify steps kept drafts, some kept none.
    assert any(a == 1 for a in accepted) and any(a > 1 for a in accepted)
