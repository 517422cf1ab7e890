"""The load shapes: a closed loop (C workers, each sends its next request when its last one
finished) and an open loop (Poisson arrivals), and `run_level`, one measured level of either,
in this process or split over `--client-procs` processes (serving/procs.py)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from serving.client import Prompt, RequestRecord, Target, send
from serving.stats import summarize


async def closed_loop(
    http: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt], concurrency: int
) -> list[RequestRecord]:
    todo = iter(prompts)  # shared by the workers: next() never yields to the event loop
    records: list[RequestRecord] = []

    async def worker() -> None:
        for prompt in todo:
            records.append(await send(http, target, prompt))

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return records


def arrival_offsets(requests: int, rate: float, rng: random.Random) -> list[float]:
    """When each request is due, in seconds after the first: Poisson arrivals (exponential gaps
    of mean 1/rate), or all at once for an infinite rate."""
    offsets, due = [], 0.0
    for i in range(requests):
        if i and math.isfinite(rate):
            due += rng.expovariate(rate)
        offsets.append(due)
    return offsets


async def open_loop(
    http: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    offsets: Sequence[float],
) -> list[RequestRecord]:
    tasks: list[asyncio.Task[RequestRecord]] = []
    base = time.perf_counter()
    for prompt, offset in zip(prompts, offsets, strict=True):
        due = base + offset
        # A loop: the event loop's timers have millisecond resolution and may fire early.
        while (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(http, target, prompt, scheduled=due)))
    return list(await asyncio.gather(*tasks))


async def measure(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    concurrency: int | None,
    warm: Sequence[Prompt],
    prompts: Sequence[Prompt],
    offsets: Sequence[float] | None,
    ready: Callable[[], object] = lambda: None,
) -> tuple[list[RequestRecord], float, float, float]:
    """A closed loop of `concurrency` workers (open loop at `offsets` if None) after the warm-up,
    on a fresh pool: (records, perf_counter at the first send and after the last stream's end,
    this process's CPU seconds in between). `ready()` runs between the warm-up and the load."""
    # Closed loop: exactly as many connections as workers. Open loop: no pool limit, or requests
    # would wait for a connection inside the client and that wait would count as server time.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        if warm:
            await closed_loop(http, target, warm, concurrency or len(warm))
        ready()
        started, cpu = time.perf_counter(), time.process_time()
        load: Awaitable[list[RequestRecord]]
        if concurrency is not None:
            load = closed_loop(http, target, prompts, concurrency)
        else:
            assert offsets is not None
            load = open_loop(http, target, prompts, offsets)
        records = await load
        ended, cpu = time.perf_counter(), time.process_time() - cpu
    return records, started, ended, cpu


async def run_level(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    level: dict[str, Any],
    warm: list[Prompt],
    prompts: list[Prompt],
    arrivals: random.Random,
    procs: int = 1,
) -> dict[str, Any]:
    concurrency = level.get("concurrency")
    offsets = None
    if concurrency is None:
        offsets = arrival_offsets(len(prompts), level["request_rate"], arrivals)
    if min(procs, len(prompts), concurrency or len(prompts)) > 1:
        from serving.procs import run_split

        return await run_split(procs, level, warm, prompts, offsets, url, headers, timeout, target)
    records, started, ended, cpu = await measure(
        url, headers, timeout, target, concurrency, warm, prompts, offsets
    )
    return summarize(level, records, ended - started, cpu)
