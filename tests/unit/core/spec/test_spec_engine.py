"""Speculative decoding through the engine core (DSpark, reference backend, tiny checkpoint with
a random `make-tiny --dspark` draft): greedy output is token-for-token the output without it —
with chunked prefill, prefix-cache hits and retraction in play — a draft that agrees with the
target gets blocks accepted, stop tokens and max_new_tokens cut inside a block, KV pages return
to the baseline, sampled requests run, and the accept-length override commits exactly L.

Each runs serially (`EngineCore.step`) and under the overlap scheduler (`overlap_step`, the
server's default: step N+1 is launched before step N's verdict is processed), against the output
without speculation run serially."""

from __future__ import annotations

import pytest
import torch

from m3serve.core.req import Req
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark import target_features
from m3serve.model.kv_cache import KVCache
from m3serve.runtime.messages import SamplingParams, SeqStep

from .engine_runs import (
    DSPARK,
    GREEDY,
    OVERLAP,
    PROMPTS,
    agreeing,
    at_baseline,
    generate,
    request,
)

# ---------------------------------------------------------------------------- greedy exactness


@OVERLAP
def test_greedy_output_is_identical_with_chunked_prefill_and_prefix_hits(
    cores, overlap: bool
) -> None:
    kwargs = {"chunked_prefill_size": 8}
    off, on = cores(**kwargs), cores(**kwargs, **DSPARK)
    # A second wave repeats the first wave's prompts with new tails: prefix-cache hits.
    second = [[*p, 400 + i] for i, p in enumerate(PROMPTS)]
    runs = {}
    for name, core in (("off", off), ("on", on)):
        mode = overlap and name == "on"
        first = generate(core, [request(f"a{i}", p) for i, p in enumerate(PROMPTS)], overlap=mode)
        again = generate(core, [request(f"b{i}", p) for i, p in enumerate(second)], overlap=mode)
        runs[name] = (first, again)
    assert runs["on"][0].outputs == runs["off"][0].outputs
    assert runs["on"][1].outputs == runs["off"][1].outputs
    assert all(len(ids) == GREEDY.max_new_tokens for ids in runs["on"][0].outputs.values())
    assert sum(runs["on"][1].cached.values()) > 0, "the second wave hit no cached prefix"
    assert any(runs["on"][0].accepted.values()), "no verify step ran"
    at_baseline(on)


@OVERLAP
def test_greedy_output_is_identical_under_retraction(cores, overlap: bool) -> None:
    # 16 pages of 4 tokens: three requests cannot all grow to the end at once.
    kwargs = {"max_total_tokens": 64}
    prompts = [list(range(9, 9 + n)) for n in (5, 7, 9)]
    off, on = cores(**kwargs), cores(**kwargs, **DSPARK)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    want = generate(off, [request(str(i), p, sampling) for i, p in enumerate(prompts)])
    got = generate(
        on, [request(str(i), p, sampling) for i, p in enumerate(prompts)], overlap=overlap
    )
    assert on.scheduler.retracted > 0, "the pool was large enough: nothing was retracted"
    assert got.outputs == want.outputs
    at_baseline(on)


# ---------------------------------------------------------------------------- acceptance


@OVERLAP
def test_a_random_draft_is_accepted_about_once_and_changes_nothing(cores, overlap: bool) -> None:
    off, on = cores(), cores(**DSPARK)
    reqs = lambda: [request(str(i), p) for i, p in enumerate(PROMPTS)]  # noqa: E731
    want, got = generate(off, reqs()), generate(on, reqs(), overlap=overlap)
    assert got.outputs == want.outputs
    lengths = [n for steps in got.accepted.values() for n in steps]
    assert lengths and sum(lengths) / len(lengths) < 1.5


@OVERLAP
def test_a_draft_that_agrees_with_the_target_gets_blocks_accepted(cores, overlap: bool) -> None:
    off, on = cores(), cores(**DSPARK)
    proposer = agreeing(on)
    reqs = lambda: [request(str(i), p) for i, p in enumerate(PROMPTS)]  # noqa: E731
    want, got = generate(off, reqs()), generate(on, reqs(), overlap=overlap)
    assert got.outputs == want.outputs
    lengths = [n for steps in got.accepted.values() for n in steps]
    assert proposer.proposed > 0
    assert sum(lengths) / len(lengths) > 2.0
    # Fewer steps than tokens: 16 tokens = 1 from the prefill + the verify steps' blocks.
    assert all(len(steps) < GREEDY.max_new_tokens - 1 for steps in got.accepted.values())
    at_baseline(on)


@OVERLAP
def test_a_stop_token_inside_an_accepted_block_ends_the_request_there(cores, overlap: bool) -> None:
    off, on = cores(), cores(**DSPARK)
    agreeing(on)
    probe = generate(off, [request("p", PROMPTS[1])]).outputs["p"]
    stop = probe[5]
    cut = probe.index(stop) + 1
    got = generate(on, [request("s", PROMPTS[1], stops=[stop])], overlap=overlap)
    assert got.outputs["s"] == probe[:cut]
    limited = SamplingParams(max_new_tokens=4, temperature=0.0)
    got = generate(on, [request("m", PROMPTS[1], limited)], overlap=overlap)
    assert got.outputs["m"] == probe[:4]
    at_baseline(on)


@OVERLAP
def test_accept_length_override_commits_exactly_that_many(cores, overlap: bool) -> None:
    on = cores(speculative_accept_length_override=3, **DSPARK)
    sampling = SamplingParams(max_new_tokens=14, temperature=0.0)
    got = generate(
        on, [request(str(i), p, sampling) for i, p in enumerate(PROMPTS)], overlap=overlap
    )
    for rid, steps in got.accepted.items():
        assert steps and all(n == 3 for n in steps), rid
        assert len(got.outputs[rid]) == 14
    at_baseline(on)


def test_a_fractional_accept_length_override_mixes_its_two_nearest_lengths(cores) -> None:
    on = cores(speculative_accept_length_override=2.5, **DSPARK)
    sampling = SamplingParams(max_new_tokens=25, temperature=0.0)
    got = generate(on, [request(str(i), p, sampling) for i, p in enumerate(PROMPTS)])
    steps = [n for rid in got.accepted for n in got.accepted[rid]]
    assert set(steps) == {2, 3}
    assert abs(sum(steps) / len(steps) - 2.5) < 0.2
    assert all(len(out) == 25 for out in got.outputs.values())
    at_baseline(on)


# ---------------------------------------------------------------------------- KV and sampling


@OVERLAP
def test_pages_return_to_the_baseline_after_aborts(cores, overlap: bool) -> None:
    on = cores(**DSPARK)
    assert on.spec is not None and on.spec.proposer is not None
    draft_slots = on.spec.proposer.kv.k[0].shape[0]  # type: ignore[attr-defined]
    assert draft_slots == on.kv.layers[0].k.shape[0], "the draft pool is not page-aligned"
    reqs = [request(str(i), p) for i, p in enumerate(PROMPTS)]
    got = generate(on, reqs, abort_after={"0": 3, "2": 9}, overlap=overlap)
    assert len(got.outputs["1"]) == GREEDY.max_new_tokens
    assert len(got.outputs["0"]) < GREEDY.max_new_tokens
    at_baseline(on)


@OVERLAP
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_sampled_requests_run_seeded(cores, block: bool, overlap: bool) -> None:
    on = cores(speculative_use_block_verification=block, **DSPARK)
    vocab = on.model.cfg.vocab_size

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, seed=seed)

    reqs = lambda: [request(str(i), p, sampled(i)) for i, p in enumerate(PROMPTS)]  # noqa: E731
    first = generate(on, reqs(), overlap=overlap)
    again = generate(on, reqs(), overlap=overlap)
    assert first.outputs == again.outputs, "a seeded request is not reproducible"
    for ids in first.outputs.values():
        assert len(ids) == 12 and all(0 <= t < vocab for t in ids)
    assert any(first.accepted.values())
    at_baseline(on)


@OVERLAP
def test_requests_a_verify_step_cannot_honour_decode_beside_it_unchanged(
    cores, overlap: bool
) -> None:
    # Penalties and logprobs depend on each token in turn: those requests decode one token per
    # step next to the verify rows, and everyone's output is the one without speculation.
    penalized = SamplingParams(max_new_tokens=10, temperature=0.0, repetition_penalty=1.3)
    logprobs = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True)
    off, on = cores(), cores(**DSPARK)

    def reqs() -> list[Req]:
        return [
            request("plain", PROMPTS[0]),
            request("penalized", PROMPTS[1], penalized),
            request("logprobs", PROMPTS[2], logprobs),
        ]

    want, got = generate(off, reqs()), generate(on, reqs(), overlap=overlap)
    assert got.outputs == want.outputs
    assert got.accepted["plain"] and not got.accepted["penalized"] and not got.accepted["logprobs"]
    at_baseline(on)


@OVERLAP
def test_the_draft_kv_of_committed_tokens_is_their_own(cores, overlap: bool) -> None:
    # After a run, the cached pages hold, at every committed position, the draft K/V computed
    # from that token's target features in one fresh prefill: verify steps wrote the accepted
    # tokens at their positions, and no rejected draft was left at a committed one.
    on = cores(**DSPARK)
    got = generate(on, [request("r", PROMPTS[2])], overlap=overlap)
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
    at_baseline(on)
