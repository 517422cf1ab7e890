"""Image input under --tp 2 (gloo ranks, one engine core per rank; only rank 0 encodes, the
followers take its features): greedy tokens equal --tp 1's for prompts with one and two images,
with chunked prefill splitting an image's placeholder span and with --ep 2; every follower
runs exactly rank 0's steps without a vision tower of its own, and rank 0's pages return to the
baseline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.core_ranks import ReqSpec, core_args, drive, pages_at_baseline, run_cores, waves_job

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec

SPEC = TinySpec(dtype="float32", seed=1)
# Chunks of 5 split the first image's 6 placeholder rows (grid 4 x 6 after a 2 x 2 merge).
KWARGS = {"chunked_prefill_size": 5}
GREEDY_TOKENS = 8


def requests(vocab: int) -> list[ReqSpec]:
    from m3serve.runtime.messages import SamplingParams

    sampling = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    two = ReqSpec("two", grids=((1, 4, 6), (1, 2, 2)), seed=10, vocab=vocab, sampling=sampling)
    one = ReqSpec("one", grids=((1, 4, 4),), seed=11, vocab=vocab, text=(3, 4), sampling=sampling)
    text = ReqSpec("text", prompt=tuple(range(5, 17)), sampling=sampling)
    return [two, one, text]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_tp_2_with_images_gives_tp_1_greedy_tokens(path: Path, ep: int) -> None:
    reference = EngineCore(core_args(path, **KWARGS), path)
    try:
        vocab = reference.model.cfg.vocab_size
        want = drive(reference, requests(vocab)).outputs
        assert pages_at_baseline(reference)
    finally:
        reference.close()
    waves = [requests(vocab)]
    per_rank = run_cores(2, path, {**KWARGS, "ep_size": ep}, waves_job, waves)
    (runs, baseline), leader_ran, media_rows = per_rank[0]
    assert runs[0].outputs == want
    assert all(len(ids) == GREEDY_TOKENS for ids in want.values())
    assert baseline, "rank 0's pages did not come back"
    # Three images of 6 + 1 + 4 placeholder rows, the 6-row span in two chunks of 5.
    with_media = [n for n in media_rows if n]
    assert sum(with_media) == 6 + 1 + 4
    assert len(with_media) >= 2
    followed, follower_ran, _ = per_rank[1]
    assert follower_ran == leader_ran
    assert followed.steps == len(leader_ran)
    assert not followed.has_vision, "a follower loaded the vision tower it never runs"
