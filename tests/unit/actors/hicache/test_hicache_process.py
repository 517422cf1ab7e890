"""The host-cache actor in its own process, started by the supervisor as launch.py starts it:
the ready handshake, a round trip through the shared pool, and death by SIGKILL with a prefetch
pending, which fails the ticket at once and leaves no segment after the supervisor's cleanup."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from m3serve.core.hicache.keys import page_keys, root_key
from m3serve.core.hicache.storage_client import DIED, HiCacheUnavailable, StorageClient
from m3serve.engine.hicache import HICACHE, hicache_client
from m3serve.engine.launch import Addresses, hicache_process
from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import Shutdown, ToHiCache, ToSupervisor
from m3serve.runtime.orphans import new_run_dir
from m3serve.runtime.shm import SHM_DIR, attach_segment, list_session_segments, new_session_id
from m3serve.runtime.supervisor import Supervisor
from m3serve.runtime.transport import ZmqInbox, ZmqOutbox

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

PAGE_BYTES = 4096
NUM_PAGES = 4
PATIENCE_S = 30.0  # a safety net; a death is noticed in milliseconds
KEYS = page_keys(root_key("tiny", 8, "float32"), list(range(16)), 8)


@dataclass
class Running:
    supervisor: Supervisor
    client: StorageClient  # the engine's
    to_actor: ZmqOutbox  # the graph's, for Shutdown
    pid: int
    deaths: list[tuple[str, int | None]]  # what the supervisor saw exit


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    session = new_session_id()
    supervisor = Supervisor(session, new_run_dir(session))
    args = ServerArgs.from_kwargs(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "store"),
    )
    addresses = Addresses.under(supervisor.run_dir, 0, hicache=True)
    assert addresses.hicache is not None and addresses.hicache_replies is not None
    control = ZmqInbox(addresses.control, Codec(ToSupervisor))
    supervisor.spawn(HICACHE, hicache_process, addresses, args, session, logging.WARNING)
    client = hicache_client(addresses.hicache, addresses.hicache_replies)
    to_actor = ZmqOutbox(addresses.hicache, Codec(ToHiCache))
    try:
        ready = await supervisor.wait_ready(control, PATIENCE_S)
        deaths: list[tuple[str, int | None]] = []
        supervisor.watch(lambda name, code: deaths.append((name, code)))
        yield Running(supervisor, client, to_actor, ready[HICACHE].pid, deaths)
    finally:
        await client.close(drain_s=0)
        await to_actor.send(Shutdown())
        await supervisor.shutdown()
        to_actor.close()
        control.close()


async def test_pages_round_trip_through_the_process(running: Running) -> None:
    ready = await running.client.open(PAGE_BYTES, NUM_PAGES, timeout=PATIENCE_S)
    assert ready.pid == running.pid
    shm = attach_segment(ready.segment)
    pages = np.frombuffer(shm.buf, np.uint8).reshape(NUM_PAGES, PAGE_BYTES)
    pages[:2] = np.random.default_rng(0).integers(0, 256, (2, PAGE_BYTES), dtype=np.uint8)
    original = pages[:2].copy()
    assert await asyncio.wait_for(running.client.backup(KEYS, [0, 1]), PATIENCE_S) == 2
    pages[:] = 0
    assert await asyncio.wait_for(running.client.prefetch(KEYS, [2, 3]), PATIENCE_S) == 2
    assert np.array_equal(pages[2:], original)
    del pages
    shm.close()


async def test_sigkill_fails_the_pending_prefetch_and_leaves_no_segment(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    session = running.supervisor.session
    ready = await running.client.open(PAGE_BYTES, NUM_PAGES, timeout=PATIENCE_S)
    assert list_session_segments(session) == [ready.segment]
    os.kill(running.pid, signal.SIGSTOP)  # so that the prefetch is surely still pending
    prefetch = running.client.prefetch(KEYS, [0, 1])
    await asyncio.sleep(0.05)
    assert not prefetch.done() and running.client.pending == 1
    loop = asyncio.get_running_loop()
    killed_at = loop.time()
    with caplog.at_level(logging.ERROR):
        os.kill(running.pid, signal.SIGKILL)
        with pytest.raises(HiCacheUnavailable, match=DIED):
            await asyncio.wait_for(prefetch, PATIENCE_S)
    assert loop.time() - killed_at < 2.0
    assert "the engine continues with HiCache disabled" in caplog.text
    assert not running.client.alive and running.client.pending == 0
    with pytest.raises(HiCacheUnavailable, match=DIED):
        running.client.backup(KEYS[:1], [0])
    await asyncio.wait_for(running.client.close(), 1.0)  # nothing left to wait for
    for _ in range(100):  # the supervisor's own notice of the exit
        if running.deaths:
            break
        await asyncio.sleep(0.02)
    assert running.deaths == [(HICACHE, -signal.SIGKILL)]
    assert list_session_segments(session) == [ready.segment]  # the killed owner left it
    await running.supervisor.shutdown()
    assert list_session_segments(session) == []


async def test_a_clean_shutdown_unlinks_the_pool_itself(running: Running) -> None:
    session = running.supervisor.session
    await running.client.open(PAGE_BYTES, NUM_PAGES, timeout=PATIENCE_S)
    await running.to_actor.send(Shutdown())
    proc = running.supervisor.procs[HICACHE]
    await asyncio.to_thread(proc.join, PATIENCE_S)
    assert proc.exitcode == 0
    assert list_session_segments(session) == []  # before any cleanup: the actor unlinked it
