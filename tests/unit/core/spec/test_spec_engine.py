"""Speculative decoding through the engine core (DSpark, reference backend, tiny checkpoint with
a random `make-tiny --dspark` draft): greedy output is token-for-token the output without it —
with chunked prefill, prefix-cache hits and retraction in play — a draft that agrees with the
target gets blocks accepted, stop tokens and max_new_tokens cut inside a block, KV pages return
to the baseline, sampled requests run, and the accept-length override commits exactly L."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark import target_features
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams, SeqStep

from .agreeing import TargetProposer

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
DSPARK = {"speculative_algorithm": "DSPARK"}
PROMPTS = [list(range(5, 5 + n)) for n in (6, 13, 29)]

MakeCheckpoint = Callable[[TinySpec], Path]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: MakeCheckpoint) -> Path:
    return tiny_checkpoint(SPEC)


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)  # per verify step
    cached: dict[str, int] = field(default_factory=dict)


def _core(path: Path, **kwargs: Any) -> EngineCore:
    kwargs.setdefault("max_total_tokens", 2048)
    args = ServerArgs.from_kwargs(model_path=str(path), device="cpu", dtype="float32", **kwargs)
    return EngineCore(args, path)


@pytest.fixture
def cores(path: Path) -> Iterator[Callable[..., EngineCore]]:
    made: list[EngineCore] = []

    def make(**kwargs: Any) -> EngineCore:
        made.append(_core(path, **kwargs))
        return made[-1]

    yield make
    for core in made:
        core.close()


def _req(rid: str, prompt: list[int], sampling: SamplingParams = GREEDY, stops=()) -> Req:
    return Req(rid=rid, prompt=prompt, sampling=sampling, stop_ids=frozenset(stops), worker=0)


def _generate(core: EngineCore, reqs: list[Req], abort_after: dict[str, int] | None = None) -> Run:
    """Run requests to the end; `abort_after[rid]`: abort it once it has that many tokens."""
    run = Run()

    async def go() -> None:
        for req in reqs:
            core.add(req)
            run.outputs[req.rid], run.accepted[req.rid] = [], []
        while core.has_work:
            out = await core.step()
            if out is None:
                break
            for batch in out.batches.values():
                rows = zip(
                    batch.rids, batch.new_ids, batch.spec_accepted, batch.cached_tokens, strict=True
                )
                for rid, ids, accepted, cached in rows:
                    run.outputs[rid].extend(ids)
                    run.cached[rid] = cached
                    if accepted:
                        run.accepted[rid].append(accepted)
            for rid, after in (abort_after or {}).items():
                if len(run.outputs[rid]) >= after:
                    core.abort(rid)

    asyncio.run(go())
    return run


def _baseline(core: EngineCore) -> None:
    """Every page is free or cached, and once the cache is dropped, free."""
    core.scheduler.idle_check()
    core.scheduler.cache.reset()
    assert core.scheduler.pool.num_free == core.scheduler.pool.num_pages


def _agreeing(core: EngineCore) -> TargetProposer:
    assert core.spec is not None
    block = core.spec.settings.block_size
    proposer = TargetProposer(core.model, core.kv, block, core.spec.proposer.layer_ids)
    core.spec.attach(
        core.runner,
        core.model,
        core.backend,
        core.budget,
        core.kv.layers[0].k.dtype,
        proposer=proposer,
    )
    return proposer


# ---------------------------------------------------------------------------- greedy exactness


def test_greedy_output_is_identical_with_chunked_prefill_and_prefix_hits(cores) -> None:
    kwargs = {"chunked_prefill_size": 8}
    off, on = cores(**kwargs), cores(**kwargs, **DSPARK)
    # A second wave repeats the first wave's prompts with new tails: prefix-cache hits.
    second = [[*p, 400 + i] for i, p in enumerate(PROMPTS)]
    runs = {}
    for name, core in (("off", off), ("on", on)):
        first = _generate(core, [_req(f"a{i}", p) for i, p in enumerate(PROMPTS)])
        again = _generate(core, [_req(f"b{i}", p) for i, p in enumerate(second)])
        runs[name] = (first, again)
    assert runs["on"][0].outputs == runs["off"][0].outputs
    assert runs["on"][1].outputs == runs["off"][1].outputs
    assert all(len(ids) == GREEDY.max_new_tokens for ids in runs["on"][0].outputs.values())
    assert sum(runs["on"][1].cached.values()) > 0, "the second wave hit no cached prefix"
    assert any(runs["on"][0].accepted.values()), "no verify step ran"
    _baseline(on)


def test_greedy_output_is_identical_under_retraction(cores) -> None:
    # 16 pages of 4 tokens: three requests cannot all grow to the end at once.
    kwargs = {"max_total_tokens": 64}
    prompts = [list(range(9, 9 + n)) for n in (5, 7, 9)]
    off, on = cores(**kwargs), cores(**kwargs, **DSPARK)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    want = _generate(off, [_req(str(i), p, sampling) for i, p in enumerate(prompts)])
    got = _generate(on, [_req(str(i), p, sampling) for i, p in enumerate(prompts)])
    assert on.scheduler.retracted > 0, "the pool was large enough: nothing was retracted"
    assert got.outputs == want.outputs
    _baseline(on)


# ---------------------------------------------------------------------------- acceptance


def test_a_random_draft_is_accepted_about_once_and_changes_nothing(cores) -> None:
    off, on = cores(), cores(**DSPARK)
    reqs = lambda: [_req(str(i), p) for i, p in enumerate(PROMPTS)]  # noqa: E731
    want, got = _generate(off, reqs()), _generate(on, reqs())
    assert got.outputs == want.outputs
    lengths = [n for steps in got.accepted.values() for n in steps]
    assert lengths and sum(lengths) / len(lengths) < 1.5


def test_a_draft_that_agrees_with_the_target_gets_blocks_accepted(cores) -> None:
    off, on = cores(), cores(**DSPARK)
    proposer = _agreeing(on)
    reqs = lambda: [_req(str(i), p) for i, p in enumerate(PROMPTS)]  # noqa: E731
    want, got = _generate(off, reqs()), _generate(on, reqs())
    assert got.outputs == want.outputs
    lengths = [n for steps in got.accepted.values() for n in steps]
    assert proposer.proposed > 0
    assert sum(lengths) / len(lengths) > 2.0
    # Fewer steps than tokens: 16 tokens = 1 from the prefill + the verify steps' blocks.
    assert all(len(steps) < GREEDY.max_new_tokens - 1 for steps in got.accepted.values())
    _baseline(on)


def test_a_stop_token_inside_an_accepted_block_ends_the_request_there(cores) -> None:
    off, on = cores(), cores(**DSPARK)
    _agreeing(on)
    probe = _generate(off, [_req("p", PROMPTS[1])]).outputs["p"]
    stop = probe[5]
    cut = probe.index(stop) + 1
    got = _generate(on, [_req("s", PROMPTS[1], stops=[stop])])
    assert got.outputs["s"] == probe[:cut]
    limited = SamplingParams(max_new_tokens=4, temperature=0.0)
    got = _generate(on, [_req("m", PROMPTS[1], limited)])
    assert got.outputs["m"] == probe[:4]
    _baseline(on)


def test_accept_length_override_commits_exactly_that_many(cores) -> None:
    on = cores(speculative_accept_length_override=3, **DSPARK)
    sampling = SamplingParams(max_new_tokens=14, temperature=0.0)
    got = _generate(on, [_req(str(i), p, sampling) for i, p in enumerate(PROMPTS)])
    for rid, steps in got.accepted.items():
        assert steps and all(n == 3 for n in steps), rid
        assert len(got.outputs[rid]) == 14
    _baseline(on)


# ---------------------------------------------------------------------------- KV and sampling


def test_pages_return_to_the_baseline_after_aborts(cores) -> None:
    on = cores(**DSPARK)
    assert on.spec is not None and on.spec.proposer is not None
    draft_slots = on.spec.proposer.kv.k[0].shape[0]  # type: ignore[attr-defined]
    assert draft_slots == on.kv.layers[0].k.shape[0], "the draft pool is not page-aligned"
    reqs = [_req(str(i), p) for i, p in enumerate(PROMPTS)]
    got = _generate(on, reqs, abort_after={"0": 3, "2": 9})
    assert len(got.outputs["1"]) == GREEDY.max_new_tokens
    assert len(got.outputs["0"]) < GREEDY.max_new_tokens
    _baseline(on)


@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_sampled_requests_run_seeded(cores, block: bool) -> None:
    on = cores(speculative_use_block_verification=block, **DSPARK)
    vocab = on.model.cfg.vocab_size

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, seed=seed)

    first = _generate(on, [_req(str(i), p, sampled(i)) for i, p in enumerate(PROMPTS)])
    again = _generate(on, [_req(str(i), p, sampled(i)) for i, p in enumerate(PROMPTS)])
    assert first.outputs == again.outputs, "a seeded request is not reproducible"
    for ids in first.outputs.values():
        assert len(ids) == 12 and all(0 <= t < vocab for t in ids)
    assert any(first.accepted.values())
    _baseline(on)


def test_requests_a_verify_step_cannot_honour_decode_beside_it_unchanged(cores) -> None:
    # Penalties and logprobs depend on each token in turn: those requests decode one token per
    # step next to the verify rows, and everyone's output is the one without speculation.
    penalized = SamplingParams(max_new_tokens=10, temperature=0.0, repetition_penalty=1.3)
    logprobs = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True)
    off, on = cores(), cores(**DSPARK)

    def reqs() -> list[Req]:
        return [
            _req("plain", PROMPTS[0]),
            _req("penalized", PROMPTS[1], penalized),
            _req("logprobs", PROMPTS[2], logprobs),
        ]

    want, got = _generate(off, reqs()), _generate(on, reqs())
    assert got.outputs == want.outputs
    assert got.accepted["plain"] and not got.accepted["penalized"] and not got.accepted["logprobs"]
    _baseline(on)


def test_the_draft_kv_of_committed_tokens_is_their_own(cores) -> None:
    # After a run, the cached pages hold, at every committed position, the draft K/V computed
    # from that token's target features in one fresh prefill: verify steps wrote the accepted
    # tokens at their positions, and no rejected draft was left at a committed one.
    on = cores(**DSPARK)
    got = _generate(on, [_req("r", PROMPTS[2])])
    assert got.accepted["r"]
    proposer = on.spec.proposer  # type: ignore[union-attr]
    draft = proposer.draft  # type: ignore[attr-defined]
    tokens = PROMPTS[2] + got.outputs["r"]
    match = on.scheduler.cache.acquire(tokens)
    page = on.budget.page_size
    n = match.num_tokens
    assert n >= len(PROMPTS[2]) + 8, "the output's pages were not cached"
    cfg = on.model.cfg
    scratch = KVCache.allocate(cfg, -(-n // page), torch.float32, "cpu")
    batch = ForwardBatch.build([SeqStep(tokens[:n], 0, list(range(-(-n // page))))], page, "cpu")
    with torch.inference_mode():
        features = target_features(on.model, batch, scratch, proposer.layer_ids)
        want = draft.context(features, torch.arange(n))
    positions = torch.arange(n)
    slots = torch.tensor(match.pages)[positions // page] * page + positions % page
    for layer, k in enumerate(want.k):
        torch.testing.assert_close(proposer.kv.k[layer][slots], k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(proposer.kv.v[layer][slots], want.v[layer], rtol=1e-4, atol=1e-4)
    on.scheduler.cache.release(tokens[:n], match.pages, match)
    _baseline(on)
