"""The host-cache actor inside a running engine: in-process with --single-process (the engine's
client reaches it and a page round-trips), and as its own process, whose death by SIGKILL leaves
the engine serving with HiCache disabled and shutdown leaving no process or segment behind.

--enable-hierarchical-cache is still refused as "not built" until the engine's host tier lands;
these tests lift just that refusal to start the actor graph as it will run."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from m3serve import AsyncEngine
from m3serve.actors.hicache import HiCacheActor
from m3serve.actors.scheduler import SchedulerActor
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.shm import attach_segment, list_session_segments

PAGE_BYTES = 4096


@pytest.fixture(autouse=True)
def hicache_allowed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    unsupported = ServerArgs.unsupported

    def without_hicache(self: ServerArgs) -> list[str]:
        return [p for p in unsupported(self) if not p.startswith("--enable-hierarchical-cache")]

    monkeypatch.setattr(ServerArgs, "unsupported", without_hicache)
    yield


def hicache_flags(tmp_path: Path) -> dict[str, object]:
    return {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "l3"),
        "max_total_tokens": 4096,
    }


async def test_in_process_the_engines_client_reaches_the_actor(
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
        assert any(isinstance(a, HiCacheActor) for a in graph.actors)
        client = scheduler.hicache
        assert client is not None and client.alive
        ready = await client.open(PAGE_BYTES, 2, timeout=10)
        shm = attach_segment(ready.segment)
        pages = np.frombuffer(shm.buf, np.uint8).reshape(2, PAGE_BYTES)
        pages[0] = 7
        key = "0f" * 32
        assert await asyncio.wait_for(client.backup([key], [0]), 10) == 1
        assert await asyncio.wait_for(client.prefetch([key], [1]), 10) == 1
        assert (pages[1] == 7).all()
        del pages
        shm.close()
        assert (await engine.generate("hello", max_new_tokens=2))["text"] is not None
    finally:
        await engine.shutdown()
    assert list_session_segments(session) == []


async def test_killing_the_host_cache_process_leaves_the_engine_serving(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await AsyncEngine.create(str(model_path), **hicache_flags(tmp_path))
    session = engine.supervisor.session  # type: ignore[union-attr]
    pids = dict(engine.processes)
    try:
        assert set(pids) == {"hicache", "engine", "tokenizer0"}
        os.kill(pids["hicache"], signal.SIGKILL)
        for _ in range(200):
            if "continues with HiCache disabled" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "the hicache process exited unexpectedly" in caplog.text
        assert engine.healthy and engine.dead is None
        result = await engine.generate("hello", max_new_tokens=2, ignore_eos=True)
        assert len(result["output_ids"]) == 2
    finally:
        await engine.shutdown()
    assert not [pid for pid in pids.values() if _alive(pid)]
    assert list_session_segments(session) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()
