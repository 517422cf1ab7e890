"""The engine processes of a `--tp N` engine beyond rank 0.

The launcher picks a free TCP port on 127.0.0.1 for the ranks' rendezvous and spawns, beside
the engine process (rank 0, with its SchedulerActor), one follower process per rank 1..N-1,
watched by the same supervisor. A follower builds the same `EngineCore` (its model shard and
KV pool), reports `Ready` on the control channel like any actor, then runs rank 0's plans until
rank 0 says stop (a clean exit) or another rank is lost (exit code 1, so the supervisor sees
it and the engine dies with every in-flight request failed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.heap import freeze_heap
from m3serve.runtime.messages import Error, RankAddress, Ready, ToSupervisor
from m3serve.runtime.transport import ZmqOutbox

log = logging.getLogger(__name__)

LOST_RANK_EXIT = 1


_FOLLOWER = "rank"  # a follower's process name: this and its rank


def follower_name(rank: int) -> str:
    return f"{_FOLLOWER}{rank}"


def is_engine_rank(name: str) -> bool:
    """Whether a supervised process is a rank of the engine: rank 0's ("engine") or a
    follower's."""
    rank = name.removeprefix(_FOLLOWER)
    return name == "engine" or (rank != name and rank.isdigit())


def rank_addresses(size: int) -> list[RankAddress]:
    """Every rank's address of one group, on a port free now (the ranks bind it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [RankAddress(rank, size, port) for rank in range(size)]


async def serve_follower(
    control_address: str, model_path: Path, args: ServerArgs, rank: RankAddress
) -> None:
    """A follower's life: start, report ready, follow rank 0, stop."""
    from m3serve.core.engine_core import EngineCore
    from m3serve.core.ranks import RankLost

    name = follower_name(rank.rank)
    control = ZmqOutbox(control_address, Codec(ToSupervisor))
    try:
        core = await asyncio.to_thread(EngineCore, args, model_path, None, rank)
    except Exception as exc:
        log.exception("%s failed to start", name)
        await control.send(Error(None, f"{name} failed to start: {exc!r}", actor=name))
        control.close()
        raise SystemExit(LOST_RANK_EXIT) from None
    freeze_heap(name)
    await control.send(Ready(name, os.getpid(), {}))
    try:
        steps = await asyncio.to_thread(core.follow)
        log.info("%s: rank 0 said stop after %d steps", name, steps)
    except RankLost as exc:
        log.error("%s: %s; exiting", name, exc)
        os._exit(LOST_RANK_EXIT)  # the group is broken: tearing it down could block
    finally:
        control.close()
    core.close()
