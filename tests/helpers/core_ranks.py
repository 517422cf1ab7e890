"""Engine cores on real ranks: N spawned processes, each an `EngineCore(rank=)` of one --tp N
group (gloo over TCP on 127.0.0.1, as the launcher starts them). Rank 0 runs a job that drives
its core; the followers `follow()` its plans. Every rank records what each step it ran gave
(step, tokens, committed blocks: without speculation a follower keeps rank 0's tokens on the
device, so every rank's record reads them back there) and rank 0 also each plan's feature-row
count, so a test can check that the followers went through exactly rank 0's steps.

The requests are built inside rank 0 (a `Req` holds pixels and is no spawn argument), from
`ReqSpec`s; `drive` runs them to the end as the scheduler actor would.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from helpers.ranks import free_port
from helpers.vision import Grid, image_prompt
from m3serve.core import step_runner
from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SKIPPED_TOKEN, RankAddress, SamplingParams, StepPlan

# (step, sampled tokens, committed blocks of verify rows) of one step on one rank.
Ran = tuple[int, list[int], list[list[int]]]
LeaderJob = Callable[..., Any]  # job(core: EngineCore, *args) -> a torch.save-able result


@dataclass(frozen=True)
class Followed:
    """What a follower rank reports: the plans it ran, and whether it loaded a vision tower."""

    steps: int
    has_vision: bool


@dataclass(frozen=True)
class ReqSpec:
    """One request: a text prompt, or (with `grids`) random text around images of those grids
    made by `helpers.vision.image_prompt` from `seed`."""

    rid: str
    prompt: tuple[int, ...] = ()
    grids: tuple[Grid, ...] = ()
    seed: int = 0
    vocab: int = 0
    text: tuple[int, ...] = (1, 9, 7)
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop_ids: tuple[int, ...] = ()

    def build(self) -> Req:
        prompt, media = list(self.prompt), []
        if self.grids:
            made = image_prompt(self.seed, self.vocab, list(self.grids), list(self.text))
            prompt, media = made.ids, made.media()
        return Req(
            rid=self.rid,
            prompt=prompt,
            sampling=self.sampling,
            stop_ids=frozenset(self.stop_ids),
            worker=0,
            media=media,
        )


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)  # per verify step


def drive(core: EngineCore, specs: list[ReqSpec]) -> Run:
    """Run the requests to the end through the overlap loop (speculation: plain steps)."""
    run = Run()

    async def go() -> None:
        for spec in specs:
            core.add(spec.build())
            run.outputs[spec.rid], run.accepted[spec.rid] = [], []
        while core.has_work or core._in_flight is not None:
            out = await core.overlap_step()
            for batch in out.batches.values() if out is not None else ():
                for rid, ids, accepted in zip(
                    batch.rids,
                    batch.new_ids,
                    batch.spec_accepted or [0] * len(batch.rids),
                    strict=True,
                ):
                    run.outputs[rid].extend(ids)
                    if accepted:
                        run.accepted[rid].append(accepted)

    asyncio.run(go())
    return run


def pages_at_baseline(core: EngineCore) -> bool:
    """Every page free once the prefix cache lets go of its pages (and no images held)."""
    scheduler = core.scheduler
    scheduler.idle_check()
    scheduler.cache.reset()
    return scheduler.pool.num_free == scheduler.pool.num_pages and not core._step_media


def core_args(path: Path, **kwargs: Any) -> ServerArgs:
    """An fp32 engine on the CPU, unless `kwargs` say otherwise."""
    defaults = {"max_total_tokens": 2048, "device": "cpu", "dtype": "float32"}
    return ServerArgs.from_kwargs(model_path=str(path), **{**defaults, **kwargs})


def run_cores(
    world: int,
    path: Path,
    kwargs: dict[str, Any],
    job: LeaderJob,
    *args: Any,
    setup: Callable[[EngineCore, int], None] | None = None,
) -> list[tuple[Any, list[Ran], list[int]]]:
    """Per rank: (rank 0's job result | a follower's `Followed`, the steps it ran, the
    feature rows each plan promised). `setup(core, rank)` runs on every rank before the job
    or the following starts (module-level, like `job`)."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        spawn_args = (world, port, path, kwargs, job, args, setup, out)
        mp.spawn(_core_main, spawn_args, nprocs=world, join=True)
        # weights_only=False: the files are our own ranks' results.
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]


def _core_main(
    rank: int,
    world: int,
    port: int,
    path: Path,
    kwargs: dict[str, Any],
    job: LeaderJob,
    args: tuple[Any, ...],
    setup: Callable[[EngineCore, int], None] | None,
    out: str,
) -> None:
    torch.set_num_threads(1)  # the ranks share the few cores
    core = EngineCore(
        core_args(path, tp_size=world, **kwargs), path, None, RankAddress(rank, world, port)
    )
    ran: list[Ran] = []
    media_rows: list[int] = []
    _record(core, ran, media_rows)
    if setup is not None:
        setup(core, rank)
    try:
        result = job(core, *args) if rank == 0 else _follow(core)
    finally:
        core.close()  # rank 0: tells the followers to stop
    torch.save((result, ran, media_rows), Path(out) / f"{rank}.pt")


def _follow(core: EngineCore) -> Followed:
    has_vision = core.model.vision is not None  # before close() drops the model
    return Followed(core.follow(), has_vision)


def _record(core: EngineCore, ran: list[Ran], media_rows: list[int]) -> None:
    run = core.runner.run
    on_device = core.runner.spec is None

    def recorded(plan: StepPlan, layers: Any = None) -> Any:
        result = run(plan, layers)
        if on_device:  # each row's next input, as rank 0 drew it (a dead row's draw too)
            slots = [seq.slot for seq in plan.seqs if seq.sample]
            tokens = core.runner.last_tokens[slots].tolist() if slots else []
        else:  # speculation: every rank drops the rows of requests that ended
            tokens = [token for token in result.tokens if token != SKIPPED_TOKEN]
        ran.append((result.step, tokens, [list(b) for b in result.spec_tokens]))
        media_rows.append(plan.media_rows)
        return result

    core.runner.run = recorded  # type: ignore[method-assign]


def waves_job(core: EngineCore, waves: list[list[ReqSpec]]) -> tuple[list[Run], bool]:
    """A leader job: each wave of requests run to the end, one after another; and whether the
    pages were back at the baseline after the last."""
    runs = [drive(core, wave) for wave in waves]
    return runs, pages_at_baseline(core)


def built_ahead_job(core: EngineCore, specs: list[ReqSpec]) -> tuple[Run, list[bool]]:
    """A leader job: the requests run to the end with each step's batch built ahead (the
    "device" stays busy a while after each launch); per batch built ahead, whether its plan
    had gone to the followers by then."""
    step_runner._device_done = _busy_a_while  # type: ignore[assignment]
    sent: list[bool] = []
    prepare = core.runner.prepare

    def spy(plan: StepPlan) -> None:
        sent.append(core._sent == plan.step)
        prepare(plan)

    core.runner.prepare = spy  # type: ignore[method-assign]
    return drive(core, specs), sent


def _busy_a_while(device: object) -> Callable[[], bool]:
    until = time.monotonic() + 0.03
    return lambda: time.monotonic() > until


class _ScrambledDraft:
    """A follower's proposer whose drafts differ from rank 0's (its draft network still runs:
    its collectives need every rank)."""

    def __init__(self, inner: Any, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab

    @property
    def layer_ids(self) -> list[int]:
        return self.inner.layer_ids

    def propose(self, *args: Any) -> Any:
        proposal = self.inner.propose(*args)
        return replace(proposal, tokens=(proposal.tokens + 1) % self.vocab)

    def commit(self, *args: Any) -> None:
        self.inner.commit(*args)


def agreeing_draft_scrambled_on_followers(core: EngineCore, rank: int) -> None:
    """A setup: every rank drafts with a proposer that agrees with the target (blocks get
    accepted), and the followers' drafts then differ from rank 0's."""
    from unit.core.spec.agreeing import TargetProposer

    spec = core.spec
    assert spec is not None and spec.proposer is not None
    block, layers = spec.settings.block_size, spec.proposer.layer_ids
    proposer: Any = TargetProposer(core.model, core.kv, block, layers)
    if rank != 0:
        proposer = _ScrambledDraft(proposer, core.model.cfg.vocab_size)
    dtype = core.kv.layers[0].k.dtype
    spec.attach(core.runner, core.model, core.backend, core.budget, dtype, proposer=proposer)
