"""HiCache under --tp 2 (gloo ranks, one engine process per rank, through `Engine`): each rank
holds a host pool of its own KV slice, rank 0's from the host-cache actor and the follower's a
segment of its own; a prefix evicted from the small device pool goes to both host pools (the
follower copies its slice of every backup rank 0 runs) and comes back for a later request with
the greedy tokens of one rank with a large pool, reported as cached; shutdown leaves no
segment. A killed follower still fails the engine within seconds and leaves nothing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.hicache_workload import (
    GREEDY,
    PREFIX,
    PROMPTS,
    SMALL_POOL,
    large_pool_outputs,
)
from helpers.serve_process import alive, wait_until

from m3serve import Engine, EngineDeadError
from m3serve.runtime.shm import list_session_segments


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[list[int]]:
    return large_pool_outputs(model_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tp_2_brings_an_evicted_prefix_back_from_both_host_pools(
    model_path: Path, expected: list[list[int]], policy: str
) -> None:
    engine = Engine(
        str(model_path),
        tp_size=2,
        max_total_tokens=SMALL_POOL,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
    )
    session = engine.async_engine.supervisor.session
    pids = dict(engine.async_engine.processes)
    try:
        # Rank 0's pool (the actor's) and the follower's own.
        assert len(list_session_segments(session)) >= 2
        outputs, cached = [], []
        for prompt in PROMPTS:
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
            outputs.append(out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
        assert outputs == expected
        assert cached[-1] == len(PREFIX)  # reloaded from the host pools, reported as cached
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in pids.values())
    assert list_session_segments(session) == []


@pytest.mark.slow
def test_a_dead_follower_with_hicache_fails_requests_and_leaves_no_segment(
    model_path: Path,
) -> None:
    engine = Engine(str(model_path), tp_size=2, enable_hierarchical_cache=True)
    session = engine.async_engine.supervisor.session
    pids = dict(engine.async_engine.processes)
    try:
        os.kill(pids["rank1"], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank1 process exited unexpectedly"):
            engine.generate("x", {"max_new_tokens": 60000, "ignore_eos": True})
        assert time.monotonic() - killed_at < 5.0
        wait_until(lambda: not alive(pids["engine"]), 5, "rank 0 gone")
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in pids.values())
    assert list_session_segments(session) == []
