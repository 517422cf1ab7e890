"""Speculative decoding (DSpark, the tiny `make-tiny --dspark` draft) under --tp 2 (gloo ranks,
one engine core per rank; the draft replicated, rank 0's drafts and verdicts shared): greedy
tokens equal --tp 1's without speculation, for text and an image prompt with chunked prefill;
every verify step's accept count is reported and equals --tp 1's with speculation; the
followers commit exactly rank 0's blocks, also when a follower's own drafts differ; rank 0's
pages return to the baseline; and a seeded sampled request runs and gives the same tokens
twice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.core_ranks import (
    ReqSpec,
    Run,
    agreeing_draft_scrambled_on_followers,
    core_args,
    drive,
    pages_at_baseline,
    run_cores,
    waves_job,
)

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
KWARGS: dict[str, Any] = {"chunked_prefill_size": 8}
DSPARK = {"speculative_algorithm": "DSPARK"}
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)


def greedy_wave(vocab: int) -> list[ReqSpec]:
    texts = [
        ReqSpec(f"t{i}", prompt=tuple(range(5, 5 + n)), sampling=GREEDY)
        for i, n in enumerate((6, 13, 29))
    ]
    image = ReqSpec("image", grids=((1, 4, 6),), seed=3, vocab=vocab, sampling=GREEDY)
    return [*texts, image]


def seeded_wave() -> list[ReqSpec]:
    return [ReqSpec("seeded", prompt=tuple(range(40, 50)), sampling=SEEDED)]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


def one_rank(path: Path, wave: list[ReqSpec], **kwargs: Any):
    core = EngineCore(core_args(path, **KWARGS, **kwargs), path)
    try:
        run = drive(core, wave)
        assert pages_at_baseline(core)
        return run
    finally:
        core.close()


@pytest.fixture(scope="module")
def tp_1(path: Path) -> tuple[Run, Run]:
    """--tp 1's greedy wave without speculation and with it."""
    vocab = TinySpec().vocab_size
    plain = one_rank(path, greedy_wave(vocab))
    spec = one_rank(path, greedy_wave(vocab), **DSPARK)
    assert spec.outputs == plain.outputs
    return plain, spec


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ep", "agreeing"), [(1, False), (2, True)], ids=["ep1", "ep2-agreeing-follower-drafts-differ"]
)
def test_tp_2_speculation_gives_tp_1_greedy_tokens(
    path: Path, tp_1: tuple[Run, Run], ep: int, agreeing: bool
) -> None:
    """`agreeing`: a draft that agrees with the target, so blocks are accepted (the random
    draft's rarely are), and the followers' own drafts differ from rank 0's."""
    plain, spec = tp_1
    waves = [greedy_wave(TinySpec().vocab_size), seeded_wave(), seeded_wave()]
    setup = agreeing_draft_scrambled_on_followers if agreeing else None
    kwargs = {**KWARGS, **DSPARK, "ep_size": ep}
    per_rank = run_cores(2, path, kwargs, waves_job, waves, setup=setup)
    (runs, baseline), leader_ran, _ = per_rank[0]
    greedy, seeded, again = runs
    assert greedy.outputs == plain.outputs
    assert all(len(ids) == GREEDY.max_new_tokens for ids in greedy.outputs.values())
    # Every verify step reports its committed count, and they are --tp 1's.
    assert all(greedy.accepted.values()), "a request ran no verify step"
    if agreeing:
        lengths = [n for steps in greedy.accepted.values() for n in steps]
        assert sum(lengths) / len(lengths) > 2.0, "the agreeing draft's blocks were not accepted"
    else:
        assert greedy.accepted == spec.accepted
    assert len(seeded.outputs["seeded"]) == SEEDED.max_new_tokens
    assert seeded.accepted["seeded"], "the sampled request ran no verify step"
    assert again.outputs == seeded.outputs
    assert baseline, "rank 0's pages did not come back"
    followed, follower_ran, _ = per_rank[1]
    assert follower_ran == leader_ran
    assert followed.steps == len(leader_ran)
    assert any(blocks for _, _, blocks in leader_ran), "no step committed a verify block"
