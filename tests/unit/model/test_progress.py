"""Load progress in a log: what a server shows while its engine process loads the weights."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.devices import CPU_REFERENCE

from m3serve.model import progress
from m3serve.model.build import load_model
from m3serve.model.progress import Progress
from m3serve.model.tiny.checkpoint import TinySpec

LOG = logging.getLogger("test.progress")


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_a_short_load_logs_its_start_and_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG.name)
    bar = Progress("Loading weights", 40, log=LOG)
    for _ in range(40):
        bar.advance()
    lines = logged(caplog)
    assert lines[0] == "Loading weights: 0/40"
    assert len(lines) == 2 and lines[1].startswith("Loading weights: 100% (")


def test_a_long_load_logs_a_line_per_tenth(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # every load counts as long
    caplog.set_level(logging.INFO, LOG.name)
    bar = Progress("Loading weights", 100, log=LOG)
    for _ in range(100):
        bar.advance()
    percents = [line.split(": ")[1].split(" ")[0] for line in logged(caplog)[1:]]
    assert percents == [f"{p}%" for p in range(10, 101, 10)]


def test_loading_a_checkpoint_into_a_log_reports_every_tensor(
    tiny_checkpoint: Callable[[TinySpec], Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG.name)
    load_model(tiny_checkpoint(TinySpec(dtype="float32", seed=1)), CPU_REFERENCE, progress=LOG)
    lines = logged(caplog)
    total = int(lines[0].removeprefix("Loading weights: 0/"))
    assert total > 0
    assert lines[-1].startswith("Loading weights: 100% (")
