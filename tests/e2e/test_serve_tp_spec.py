"""Speculative decoding through `Engine` with --tp 2 (one engine process per rank, gloo): the
greedy tokens of --tp 1 without speculation, the acceptance reported in `meta_info`, and no
process left after shutdown."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.serve_process import alive

from m3serve import Engine
from m3serve.model.tiny.checkpoint import TinySpec

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
PROMPTS = ["Hello there", "1 2 3 4"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.slow
def test_tp_2_speculation_through_the_engine_gives_tp_1_greedy_tokens(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    path = str(tiny_checkpoint(SPEC))
    reference = Engine(path, single_process=True)
    try:
        want = [out["output_ids"] for out in reference.generate(PROMPTS, GREEDY)]
    finally:
        reference.shutdown()
    engine = Engine(path, tp_size=2, speculative_algorithm="DSPARK")
    pids = dict(engine.async_engine.processes)
    try:
        assert engine.async_engine.info["tp_size"] == 2
        assert engine.async_engine.info["speculative_num_draft_tokens"] == 8
        outs = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert [out["output_ids"] for out in outs] == want
    for out in outs:
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] >= 1.0
    assert "rank1" in pids
    assert not any(alive(pid) for pid in pids.values())
