"""The load shapes: a closed loop (C workers, each sends its next request when its last one
finished) and an open loop (Poisson arrivals), and `run_level`, one measured level of either."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Sequence
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


async def open_loop(
    http: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    rate: float,
    rng: random.Random,
) -> list[RequestRecord]:
    tasks: list[asyncio.Task[RequestRecord]] = []
    due = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(rate):
            due += rng.expovariate(rate)
            # A loop: the event loop's timers have millisecond resolution and may fire early.
            while (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(http, target, prompt, scheduled=due)))
    return list(await asyncio.gather(*tasks))


async def run_level(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    level: dict[str, Any],
    warm: list[Prompt],
    prompts: list[Prompt],
    arrivals: random.Random,
) -> dict[str, Any]:
    concurrency = level.get("concurrency")
    # Closed loop: exactly as many connections as workers. Open loop: no pool limit, or requests
    # would wait for a connection inside the client and that wait would count as server time.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        if warm:
            await closed_loop(http, target, warm, concurrency or len(warm))
        started, cpu = time.perf_counter(), time.process_time()
        measure: Awaitable[list[RequestRecord]]
        if concurrency is not None:
            measure = closed_loop(http, target, prompts, concurrency)
        else:
            measure = open_loop(http, target, prompts, level["request_rate"], arrivals)
        records = await measure
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return summarize(level, records, wall, cpu)
