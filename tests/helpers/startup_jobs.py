"""The start-up passes a GPU engine runs before ready — the warm-up over every step-shape class
and the step-cost timing — run on every rank of a CPU (gloo) group, as `run_cores` setups.

On a GPU `EngineCore.__init__` runs both on every rank (core/engine_start.py); on the CPU it
skips them (nothing compiles, and CPU times drive no budget), so these setups call the same
functions with small limits to show the ranks' collectives pair up through them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from helpers.kernel_classes import KernelClasses
from m3serve.core.engine_core import EngineCore
from m3serve.core.engine_start import max_step_tokens, warm_up
from m3serve.core.step_cost import measure_step_cost
from m3serve.core.warmup_record import Recorder
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import StepPlan, StepResult

# Small enough that the warm-up's few hundred steps take seconds on two CPU ranks.
KWARGS = {
    "max_running_requests": 3,
    "chunked_prefill_size": 24,
    "context_length": 96,
    "max_total_tokens": 512,
}


def warm_up_and_time(core: EngineCore, rank: int) -> None:
    """A setup: the warm-up, then the step-cost measurement, on this rank (every rank runs
    it, in the same order, as on GPUs)."""
    args = ServerArgs.from_kwargs(**KWARGS)
    slots, context = args.sched.max_running_requests, KWARGS["context_length"]
    warm_up(args, core.runner, core.budget, None, context, slots)
    budget = core.budget
    measure_step_cost(
        core.runner.time_step,
        lambda: None,
        [1, 2, slots],
        budget.page_size,
        budget.num_pages,
        max_step_tokens(args.sched, slots, budget),
        core.model.cfg.vocab_size,
    )


@contextmanager
def _counting(core: EngineCore, rank: int) -> Iterator[KernelClasses]:
    """The runner's steps, each also seen by a fresh `KernelClasses` (a fresh process's)."""
    kernels = KernelClasses(rank)
    run = core.runner.run

    def counted(plan: StepPlan, layers: Sequence[int] | None = None) -> StepResult:
        kernels.see(plan)
        return run(plan, layers)

    core.runner.run = counted  # type: ignore[method-assign]
    try:
        yield kernels
    finally:
        del core.runner.run  # the class's method again


def shared_record_dir(parent: int) -> Path:
    """The warm-up record directory the ranks of test process `parent` share."""
    return Path(tempfile.gettempdir()) / f"m3serve-warmup-{parent}"


def warm_up_from_one_record(core: EngineCore, rank: int) -> None:
    """A setup: the warm-up three times on this rank, each as a fresh process would (no kernel
    in yet), with a record in a directory the ranks share (core/warmup_record.py): the whole
    pass, which rank 0 records for both; the record's plans, which bring in every kernel class
    the whole pass brought in on each rank; and, with rank 1 looking elsewhere (no record),
    the whole pass on both again."""
    args = ServerArgs.from_kwargs(**KWARGS)
    slots, context = args.sched.max_running_requests, KWARGS["context_length"]
    shared = shared_record_dir(os.getppid())
    runs = []
    for attempt in range(3):
        directory = shared / "elsewhere" if attempt == 2 and rank == 1 else shared
        with _counting(core, rank) as kernels:
            recorder = Recorder(directory, {"test": "ranks"}, kernels.count, core.ranks)
            done = warm_up(args, core.runner, core.budget, None, context, slots, recorder)
        runs.append((done, kernels.loaded))
        dist.barrier(group=core.ranks.host)  # the record is written before anyone reads it
    (whole, cold), (again, warm), (apart, _) = runs
    assert not whole.recorded and whole.steps == whole.plans
    assert again.recorded and again.steps < whole.plans
    assert warm == cold  # every class this rank needs, though not all its plans were its own
    assert not apart.recorded and apart.steps == whole.plans
