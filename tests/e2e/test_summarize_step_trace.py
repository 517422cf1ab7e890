"""perf/summarize_step_trace.py reads the lines `--enable-step-trace` writes (StepRecord.line)."""

from __future__ import annotations

from pathlib import Path

import pytest
from summarize_step_trace import steps

from m3serve.core.trace import StepRecord
from m3serve.runtime.messages import SeqStep, StepPlan


def test_the_summary_parses_the_trace_lines_the_engine_writes(tmp_path: Path) -> None:
    decode = StepPlan(step=7, seqs=[SeqStep(None, 10, [0], slot=0), SeqStep(None, 9, [1], slot=1)])
    mixed = StepPlan(step=8, seqs=[SeqStep([1, 2, 3], 0, [2], slot=2), SeqStep(None, 11, [0])])
    lines = []
    for stamp, plan, run_ms in (("00,100", decode, 3.5), ("00,104", mixed, 4.25)):
        record = StepRecord(plan, schedule_ms=0.1, run_ms=run_ms, process_ms=0.05)
        lines.append(f"2026-12-03 13:50:{stamp} INFO [engine] m3serve.core.trace: {record.line()}")
    log = tmp_path / "serve.log"
    log.write_text("\n".join(["unrelated line", *lines]) + "\n")
    (first, second) = steps(log)
    assert first[1:5] == (7, "decode", 2, 2)
    assert second[1:5] == (8, "mixed", 2, 4)
    assert second[0] - first[0] == pytest.approx(0.004, abs=1e-5)
    assert second[5:] == pytest.approx((0.15, 0.1, 0.05, 4.25))
