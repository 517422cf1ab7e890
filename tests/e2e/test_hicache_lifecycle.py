"""The host-cache actor inside a running engine: in-process with --single-process (the engine's
host pool is the actor's segment), and as its own process, whose death by SIGKILL while a
request waits on an L3 prefetch fails that request with a clear error and leaves the engine
serving with HiCache disabled, and shutdown leaving no process or segment behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.hf_oracle import random_prompt
from helpers.metrics_text import samples
from prometheus_client import generate_latest

from m3serve import AsyncEngine
from m3serve.actors.hicache import HiCacheActor
from m3serve.actors.scheduler import SchedulerActor
from m3serve.core.hicache.storage_tier import DIED_WHILE_FETCHING
from m3serve.engine.errors import RequestError
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.shm import attach_segment, list_session_segments

PATIENCE_S = 30.0  # safety nets: nothing here should take more than a fraction of it
VOCAB = TinySpec().vocab_size - 64


def hicache_flags(tmp_path: Path) -> dict[str, object]:
    return {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "l3"),
        "max_total_tokens": 4096,
    }


async def test_in_process_the_engines_host_pool_is_the_actors(
    model_path: Path, tmp_path: Path
) -> None:
    engine = await AsyncEngine.create(
        str(model_path), single_process=True, **hicache_flags(tmp_path)
    )
    session = engine.supervisor.session  # type: ignore[union-attr]
    try:
        graph = engine._graph
        assert graph is not None
        (scheduler,) = [a for a in graph.actors if isinstance(a, SchedulerActor)]
        (actor,) = [a for a in graph.actors if isinstance(a, HiCacheActor)]
        assert scheduler.core is not None and scheduler.core.host is not None
        assert actor.pool is not None and scheduler.hicache is not None
        host = scheduler.core.host.pool
        assert host.segment_name == actor.pool.name  # one pool, made by the actor
        assert (host.num_pages, host.page_bytes) == (actor.pool.num_pages, actor.pool.page_bytes)
        shm = attach_segment(actor.pool.name)
        seen = np.frombuffer(shm.buf, np.uint8, count=host.page_bytes)
        host.raw[0, :8] = 7  # the engine's write is in the actor's segment
        assert (seen[:8] == 7).all()
        host.raw[0, :8] = 0
        del seen
        shm.close()
        assert (await engine.generate("hello", max_new_tokens=2))["text"] is not None
    finally:
        await engine.shutdown()
    assert list_session_segments(session) == []


async def test_killing_the_host_cache_process_during_a_prefetch_fails_only_that_request(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await AsyncEngine.create(str(model_path), **hicache_flags(tmp_path))
    session = engine.supervisor.session  # type: ignore[union-attr]
    pids = dict(engine.processes)
    try:
        assert set(pids) == {"hicache", "engine", "tokenizer0"}
        # Stopped, the actor answers no prefetch: a new prompt of whole pages waits on its own.
        os.kill(pids["hicache"], signal.SIGSTOP)
        waiting = asyncio.create_task(
            engine.generate(input_ids=random_prompt(800, 30, VOCAB), max_new_tokens=4)
        )
        await until_waiting(engine, 1)
        os.kill(pids["hicache"], signal.SIGKILL)
        with pytest.raises(RequestError, match="died while this request's prefix") as failed:
            await asyncio.wait_for(waiting, PATIENCE_S)
        assert str(failed.value) == DIED_WHILE_FETCHING and failed.value.code == 500
        assert "the hicache process exited unexpectedly" in caplog.text
        assert engine.healthy and engine.dead is None
        # Later requests run, without HiCache, a repeated prefix from the device cache.
        prompt = random_prompt(801, 30, VOCAB)
        for _ in range(2):
            result = await asyncio.wait_for(
                engine.generate(input_ids=prompt, max_new_tokens=2, ignore_eos=True), PATIENCE_S
            )
            assert len(result["output_ids"]) == 2
        assert result["meta_info"]["cached_tokens"] == 28
    finally:
        await engine.shutdown()
    assert not [pid for pid in pids.values() if _alive(pid)]
    assert list_session_segments(session) == []


async def until_waiting(engine: AsyncEngine, count: int) -> None:
    """Until the engine's metrics show `count` requests waiting to be admitted."""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        registry = engine.metrics
        assert registry is not None
        if samples(generate_latest(registry).decode()).get("m3serve:num_waiting_reqs") == count:
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"never {count} requests waiting")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()
