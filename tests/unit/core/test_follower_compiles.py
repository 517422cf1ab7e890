"""A follower rank's step that compiled a Triton kernel is logged as a warning, as rank 0's steps
are (a compile after ready stalls every rank at the next collective); a step that compiled
nothing logs nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from m3serve.core.engine_core import EngineCore
from m3serve.core.trace import StepTrace
from m3serve.model.parallel import RankGroup
from m3serve.runtime.messages import StepPlan


def follower(compiles: list[str]) -> SimpleNamespace:
    trace = StepTrace(log_every_step=False)

    def run(plan: StepPlan) -> None:  # stands in for the runner: "compiles" while it runs
        trace.compiles.names.extend(compiles)

    return SimpleNamespace(trace=trace, runner=SimpleNamespace(run=run), ranks=RankGroup(1, 2))


def test_a_follower_step_that_compiled_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    core = follower(["gate_up_kernel", "down_kernel"])
    with caplog.at_level(logging.WARNING, logger="m3serve.core.engine_core"):
        EngineCore._run_followed(core, StepPlan(step=41, seqs=[]))  # type: ignore[arg-type]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("rank 1: step 41 compiled 2: gate_up_kernel, down_kernel")
    core.trace.close()


def test_a_follower_step_that_compiled_nothing_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    core = follower([])
    with caplog.at_level(logging.INFO, logger="m3serve.core.engine_core"):
        EngineCore._run_followed(core, StepPlan(step=42, seqs=[]))  # type: ignore[arg-type]
    assert caplog.records == []
    core.trace.close()
