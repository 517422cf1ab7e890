"""Driving an EngineCore in-process until every request has finished, collecting what each step
handed back: the one loop the engine-core, vision and speculative-decoding tests share; and the
factory fixture body that closes every core a test made."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams

# A core that keeps work it can never run would spin forever; fail instead of hanging the suite.
MAX_STEPS = 100_000


@dataclass
class CoreRun:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)  # per verify step
    cached: dict[str, int] = field(default_factory=dict)  # the prefix-cache hit, as usage reports
    steps: int = 0  # core steps taken so far, empty ones included


def run_to_end(
    core: EngineCore,
    reqs: list[Req],
    overlap: bool = True,
    after_step: Callable[[CoreRun], None] | None = None,
) -> CoreRun:
    """Add `reqs`, then step (`overlap_step` or serial `step`) until the core has no work and
    nothing in flight. `after_step` sees the run after every step (a test aborts from there)."""
    run = CoreRun()

    async def go() -> None:
        for req in reqs:
            core.add(req)
            run.outputs[req.rid], run.accepted[req.rid] = [], []
        while core.has_work or core._in_flight is not None:
            assert run.steps < MAX_STEPS, "the engine core never finished its requests"
            out = await (core.overlap_step() if overlap else core.step())
            run.steps += 1
            for batch in out.batches.values() if out is not None else ():
                accepted = batch.spec_accepted or [0] * len(batch.rids)
                rows = zip(batch.rids, batch.new_ids, accepted, batch.cached_tokens, strict=True)
                for rid, ids, verified, cached in rows:
                    run.outputs[rid].extend(ids)
                    run.cached[rid] = cached
                    if verified:
                        run.accepted[rid].append(verified)
            if after_step is not None:
                after_step(run)

    asyncio.run(go())
    return run


def small_cpu_core(path: Path, **args: object) -> EngineCore:
    """An fp32 engine core on the CPU with 4 slots and a 2048-token pool, plus `args`."""
    server = ServerArgs.from_kwargs(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048,
        max_running_requests=4, **args,
    )  # fmt: skip
    return EngineCore(server, path)


def greedy_outputs(
    core: EngineCore,
    prompts: list[list[int]],
    outputs: list[int],
    stops: dict[int, int] | None = None,
) -> dict[str, list[int]]:
    """Greedy outputs of requests r0.. (`outputs[i]` tokens at most; `stops`: a stop token for
    some of them), their prompts prefilled again (the prefix cache reset first)."""
    stops = stops or {}
    reqs = [
        Req(
            rid=f"r{i}",
            prompt=list(prompt),
            sampling=SamplingParams(max_new_tokens=out, temperature=0.0),
            stop_ids=frozenset([stops[i]] if i in stops else []),
            worker=0,
        )
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))
    ]
    core.scheduler.cache.reset()
    return run_to_end(core, reqs).outputs


def closing_cores(build: Callable[..., EngineCore]) -> Iterator[Callable[..., EngineCore]]:
    """A fixture's body: yields `build` (kwargs -> a new core) and closes every core it made."""
    made: list[EngineCore] = []

    def make(**kwargs: object) -> EngineCore:
        made.append(build(**kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for core in made:
            core.close()
