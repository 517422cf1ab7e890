"""runtime/heap.py: what an owned process's start-up leaves is kept out of later collections,
and only an actor that owns its process freezes it."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from m3serve.runtime.actor import Actor
from m3serve.runtime.heap import freeze_heap
from m3serve.runtime.messages import Shutdown
from m3serve.runtime.transport import InProcChannel


@pytest.fixture
def thawed() -> Iterator[None]:
    """The test process's heap unfrozen before and after (pytest owns this process)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_frozen_start_up_heap_is_left_out_of_collections(thawed: None) -> None:
    kept = _Node()
    assert freeze_heap("test") == gc.get_freeze_count() > 0
    assert gc.is_tracked(kept) and kept not in gc.get_objects()  # the permanent generation
    garbage = _Node()
    del garbage
    assert gc.collect() >= 1  # what is made after the freeze is still collected


async def _serve_once(own_process: bool) -> int:
    channel: InProcChannel[Shutdown] = InProcChannel()
    actor = Actor(channel.inbox())
    await channel.outbox().send(Shutdown())
    await actor.serve(own_process=own_process)
    return gc.get_freeze_count()


def test_only_an_actor_that_owns_its_process_freezes_the_heap(thawed: None) -> None:
    assert asyncio.run(_serve_once(own_process=False)) == 0
    assert asyncio.run(_serve_once(own_process=True)) > 0


def test_a_frozen_process_exits_without_extension_objects_left_alive() -> None:
    # Frozen to the end, xgrammar's and Triton's nanobind objects outlived the interpreter and
    # nanobind printed a "leaked" line for each at every server shutdown.
    code = (
        "import xgrammar, triton\n"
        "from m3serve.runtime.heap import freeze_heap\n"
        "freeze_heap('test')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "leaked" not in done.stderr
