"""--enable-step-trace on a running engine: one line per step, prefill first, then decode."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from m3serve import Engine


def test_the_engine_traces_a_request_prefill_first_then_decode(
    model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="m3serve.core.trace"),
        Engine(str(model_path), single_process=True, enable_step_trace=True) as engine,
    ):
        engine.generate(input_ids=[1, 2, 3, 4, 5, 6], sampling_params={"max_new_tokens": 3})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].startswith("step 1 prefill batch=1 tokens=6 ")
    assert all(" decode batch=1 tokens=1 " in line for line in lines[1:])
    assert len(lines) >= 3
