"""Running a function on N real ranks: `torch.multiprocessing` spawn, a gloo group over TCP on
127.0.0.1, each rank's return value saved with `torch.save` and handed back in rank order."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3serve.model.parallel import RankGroup

RankJob = Callable[..., Any]  # job(ranks: RankGroup, *args) -> a torch.save-able result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(world: int, job: RankJob, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Each rank's `job(RankGroup, *args)` result, in rank order. `job` must be importable
    (a module-level function) since the ranks are spawned processes."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        mp.spawn(_rank_main, (world, port, job, args, out, timeout_s), nprocs=world, join=True)
        # weights_only=False: the files are our own ranks' results (tensors and structs).
        return [torch.load(Path(out) / f"{rank}.pt", weights_only=False) for rank in range(world)]


def start_ranks(world: int, job: RankJob, *args: Any, timeout_s: float = 30.0) -> list[Any]:
    """The rank processes running `job(RankGroup, *args)`, started and not waited for (a test
    that kills or loses a rank watches them itself); results are dropped."""
    context = mp.get_context("spawn")
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(r, world, port, job, args, None, timeout_s))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    return procs


def _rank_main(
    rank: int,
    world: int,
    port: int,
    job: RankJob,
    args: tuple[Any, ...],
    out: str | None,
    timeout_s: float,
) -> None:
    # One intra-op thread per rank: the ranks already share the few cores.
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = job(RankGroup(rank, world), *args)
        if out is not None:
            torch.save(result, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
