"""The start-up passes a GPU engine runs before ready — the warm-up over every step-shape class
and the step-cost timing — run on every rank of a CPU (gloo) group, as `run_cores` setups.

On a GPU `EngineCore.__init__` runs both on every rank (core/engine_start.py); on the CPU it
skips them (nothing compiles, and CPU times drive no budget), so these setups call the same
functions with small limits to show the ranks' collectives pair up through them.
"""

from __future__ import annotations

from m3serve.core.engine_core import EngineCore
from m3serve.core.engine_start import max_step_tokens, warm_up
from m3serve.core.step_cost import measure_step_cost
from m3serve.runtime.config import ServerArgs

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
