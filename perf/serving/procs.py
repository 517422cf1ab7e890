"""`--client-procs N`: one level's load split over N client processes (multiprocessing spawn),
so that one Python process's CPU (its event loop parsing every stream) does not add its own
delay to the stamps it takes.

A closed loop's C workers go C // N (+1 for the first C % N) to each process, with the prompts
in proportion; an open loop's arrivals (one Poisson schedule, drawn here exactly as in one
process) go round-robin, request i to process i % N. Each process warms up its own connection
pool on its share of the warm-up prompts, waits at a barrier for the others, then runs the usual
async loop (serving/load.py `measure`) and sends back its RequestRecords, which are plain data.
Every statistic is then computed here over the merged records exactly as for one process."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import queue
import time
import traceback
from multiprocessing.synchronize import Barrier
from typing import Any

from serving.client import Prompt, RequestRecord
from serving.load import measure
from serving.stats import summarize

BARRIER_S = 600.0  # the longest a process waits for the others' warm-ups before giving up


def shares(
    procs: int,
    level: dict[str, Any],
    warm: list[Prompt],
    prompts: list[Prompt],
    offsets: list[float] | None,
    *common: Any,
) -> list[tuple[Any, ...]]:
    """Each process's arguments to `measure`: `common` (url, headers, timeout, target), then
    its workers (None: open loop), warm-up prompts, prompts and arrival offsets."""
    concurrency = level.get("concurrency")
    if concurrency is None:  # round-robin: each process's arrivals are every n-th one
        n = min(procs, len(prompts))
        assert offsets is not None
        return [(*common, None, warm[i::n], prompts[i::n], offsets[i::n]) for i in range(n)]
    n = min(procs, concurrency, len(prompts))
    edges = [i * concurrency // n for i in range(n + 1)]  # near-even worker counts

    def cut(seq: list[Prompt], i: int) -> list[Prompt]:  # in proportion to the workers
        return seq[edges[i] * len(seq) // concurrency : edges[i + 1] * len(seq) // concurrency]

    return [
        (*common, edges[i + 1] - edges[i], cut(warm, i), cut(prompts, i), None) for i in range(n)
    ]


def child(index: int, share: tuple[Any, ...], barrier: Barrier, results: mp.Queue[Any]) -> None:
    from serving.runner import event_loop_run

    async def go() -> dict[str, Any]:
        # Each process's load starts once every process has warmed up.
        ready = functools.partial(barrier.wait, BARRIER_S)
        records, started, ended, cpu = await measure(*share, ready=ready)
        # perf_counter's reference point is undefined and may differ between processes, so
        # only differences of one process's stamps are used (every per-request metric is one);
        # the level's window is taken to time.time() through this process's own offset between
        # the two clocks, sampled once (time.time may be slewed by NTP: ppm over a level).
        offset = time.time() - time.perf_counter()
        return {
            "records": records,
            "start": started + offset,
            "end": ended + offset,
            "offset": offset,
            "cpu": cpu,
        }

    try:
        results.put((index, event_loop_run(go())))
    except BaseException:
        barrier.abort()  # the others stop waiting for this one
        results.put((index, traceback.format_exc(limit=4)))


def collect(results: mp.Queue[Any], workers: list[Any]) -> list[dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    while len(got) < len(workers):
        try:
            index, result = results.get(timeout=1.0)
        except queue.Empty:
            if dead := [p.exitcode for p in workers if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process died (exit codes {dead})") from None
            continue
        if isinstance(result, str):
            raise RuntimeError(f"client process {index} failed:\n{result}")
        got[index] = result
    return [got[i] for i in range(len(workers))]


async def run_split(
    procs: int,
    level: dict[str, Any],
    warm: list[Prompt],
    prompts: list[Prompt],
    offsets: list[float] | None,
    *common: Any,
) -> dict[str, Any]:
    """One level over `procs` client processes; `common`: url, headers, timeout, target."""
    parts = shares(procs, level, warm, prompts, offsets, *common)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(parts)), ctx.Queue()
    workers = [
        ctx.Process(target=child, args=(i, s, barrier, results), daemon=True)
        for i, s in enumerate(parts)
    ]
    for p in workers:
        p.start()
    try:
        done = await asyncio.to_thread(collect, results, workers)
    finally:
        for p in workers:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
    records: list[RequestRecord]
    if level.get("concurrency") is None:  # send order: request i was process i % n's (i // n)th
        records = [done[i % len(done)]["records"][i // len(done)] for i in range(len(prompts))]
    else:  # the order they finished in, as one process appends them
        ends = [(r.start + r.e2e_done + d["offset"], r) for d in done for r in d["records"]]
        records = [r for _, r in sorted(ends, key=lambda pair: pair[0])]
    wall = max(d["end"] for d in done) - min(d["start"] for d in done)
    result = summarize(level, records, wall, sum(d["cpu"] for d in done))
    return result | {
        "client_procs": len(done),
        "client_cpu_util_max": max(d["cpu"] / (d["end"] - d["start"]) for d in done),
    }
