"""The engine-core runs the speculative-decoding tests share: a CPU core on the tiny DSpark
checkpoint, requests, a run to the end (serial `step` or the overlap loop), the pool baseline and
the agreeing draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.core_runs import CoreRun, run_to_end

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams

from .agreeing import TargetProposer

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
DSPARK = {"speculative_algorithm": "DSPARK"}
PROMPTS = [list(range(5, 5 + n)) for n in (6, 13, 29)]


def make_core(path: Path, **kwargs: Any) -> EngineCore:
    kwargs.setdefault("max_total_tokens", 2048)
    args = ServerArgs.from_kwargs(model_path=str(path), device="cpu", dtype="float32", **kwargs)
    return EngineCore(args, path)


def request(
    rid: str,
    prompt: list[int],
    sampling: SamplingParams = GREEDY,
    stops: tuple[int, ...] | list[int] = (),
) -> Req:
    return Req(rid=rid, prompt=prompt, sampling=sampling, stop_ids=frozenset(stops), worker=0)


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])


def generate(
    core: EngineCore,
    reqs: list[Req],
    abort_after: dict[str, int] | None = None,
    overlap: bool = False,
) -> CoreRun:
    """Run requests to the end; `abort_after[rid]`: abort it once it has that many tokens (with
    overlap, while its next step is in flight)."""

    def abort(run: CoreRun) -> None:
        for rid, after in (abort_after or {}).items():
            if len(run.outputs.get(rid, ())) >= after:
                core.abort(rid)

    return run_to_end(core, reqs, overlap=overlap, after_step=abort)


def at_baseline(core: EngineCore) -> None:
    """Every page is free or cached, and once the cache is dropped, free."""
    core.scheduler.idle_check()
    core.scheduler.cache.reset()
    assert core.scheduler.pool.num_free == core.scheduler.pool.num_pages


def agreeing(core: EngineCore) -> TargetProposer:
    assert core.spec is not None
    block = core.spec.settings.block_size
    proposer = TargetProposer(core.model, core.kv, block, core.spec.proposer.layer_ids)
    core.spec.attach(
        core.runner,
        core.model,
        core.backend,
        core.budget,
        core.kv.layers[0].k.dtype,
        proposer=proposer,
    )
    return proposer
