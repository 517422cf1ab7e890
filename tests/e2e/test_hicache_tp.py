"""HiCache under --tp 2 (gloo ranks, one engine process per rank, through `Engine`): each rank
holds a host pool of its own KV slice, all in the host-cache actor's one segment; a prefix
evicted from the small device pool goes to both host pools (the follower copies its slice of
every backup rank 0 runs) and comes back for a later request with the greedy tokens of one rank
with a large pool, reported as cached; with L3 storage a second --tp 2 server fetches the
prefix from the files the first one wrote (one per rank per page), and a --tp 1 server does not
take them for its own pages; shutdown leaves no segment. A killed follower still fails the
engine within seconds and leaves nothing."""

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
        # One segment, the actor's, holds both ranks' pools.
        assert len(list_session_segments(session)) == 1
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


def l3(store: Path) -> dict[str, object]:
    return {
        "max_total_tokens": SMALL_POOL,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(store),
    }


@pytest.mark.slow
def test_a_tp_2_replica_fetches_every_ranks_piece_from_l3(
    model_path: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    store = tmp_path / "l3"
    with Engine(str(model_path), tp_size=2, **l3(store)) as first:
        for prompt in PROMPTS[:-1]:
            first.generate(input_ids=prompt, sampling_params=GREEDY)
    files = [p for p in store.glob("*/*") if not p.name.startswith(".")]
    assert len(files) >= 2 * len(PREFIX) // 4  # both ranks' pieces of the prefix's 10 pages
    with Engine(str(model_path), tp_size=2, **l3(store)) as replica:
        out = replica.generate(input_ids=PROMPTS[-1], sampling_params=GREEDY)
    assert out["output_ids"] == expected[-1]
    assert out["meta_info"]["cached_tokens"] == len(PREFIX)  # fetched from L3
    with Engine(str(model_path), single_process=True, skip_warmup=True, **l3(store)) as one:
        out = one.generate(input_ids=PROMPTS[-1], sampling_params=GREEDY)
    assert out["output_ids"] == expected[-1]
    assert out["meta_info"]["cached_tokens"] == 0  # tp 2 pieces are no tp 1 pages
