"""perf/summarize_step_trace.py reads the lines `--enable-step-trace` writes (StepRecord.line),
windows them and lists the slowest steps."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
from summarize_step_trace import (
    allocator_lines,
    chunk_costs,
    consecutive,
    gc_pauses,
    in_window,
    launches_by_kind,
    main,
    percentile,
    steps,
    token_gaps,
    weighted_percentile,
)

import m3serve.core.trace as trace_module
from m3serve.core.trace import StepRecord, StepTrace
from m3serve.runtime.messages import SeqStep, StepPlan


def test_the_summary_parses_the_trace_lines_the_engine_writes(tmp_path: Path) -> None:
    decode = StepPlan(step=7, seqs=[SeqStep(None, 10, [0], slot=0), SeqStep(None, 9, [1], slot=1)])
    mixed = StepPlan(step=8, seqs=[SeqStep([1, 2, 3], 0, [2], slot=2), SeqStep(None, 11, [0])])
    lines = []
    shapes = (("00,100", decode, 3.5, 0.0, 0.0, 0.0), ("00,104", mixed, 4.25, 1.5, 3.75, 0.5))
    for stamp, plan, run_ms, gc_ms, launch_ms, build_ms in shapes:
        record = StepRecord(
            plan,
            schedule_ms=0.1,
            run_ms=run_ms,
            process_ms=0.05,
            gc_ms=gc_ms,
            gc_full_ms=gc_ms * 0.8,
            budget=384,
            budget_rows=16,
            idle_ms=0.5,
            lag_ms=0.25,
            launch_ms=launch_ms,
            build_ms=build_ms,
        )
        lines.append(f"2026-12-03 13:50:{stamp} INFO [engine] m3serve.core.trace: {record.line()}")
    log = tmp_path / "serve.log"
    log.write_text("\n".join(["unrelated line", *lines]) + "\n")
    (first, second) = steps(log)
    assert first[1:5] == (7, "decode", 2, 2)
    assert second[1:5] == (8, "mixed", 2, 4)
    assert second[0] - first[0] == pytest.approx(0.004, abs=1e-5)
    assert first.gc_ms == 0.0  # no pause: nothing logged
    assert first.budget == 0  # a decode step logs no budget
    assert second[5:10] == pytest.approx((0.15, 0.1, 0.05, 4.25, 1.5))
    assert (second.budget, second.budget_rows) == (384, 16)
    assert (second.idle_ms, second.lag_ms) == (0.5, 0.25)
    assert (first.launch_ms, second.launch_ms) == (0.0, 3.75)
    assert (first.gc_full_ms, second.gc_full_ms) == (0.0, 1.2)
    assert (first.build_ms, second.build_ms) == (0.0, 0.5)  # the first was built ahead


def test_lines_of_older_servers_without_idle_and_lag_still_parse(tmp_path: Path) -> None:
    line = (
        "2026-12-03 13:50:00,100 INFO [engine] m3serve.core.trace: step 7 decode batch=2 "
        "tokens=2 host=0.15ms (plan 0.10 + process 0.05) run=3.50ms gc=1.50ms"
    )
    (tmp_path / "old.log").write_text(line + "\n")
    (row,) = steps(tmp_path / "old.log")
    assert (row.run_ms, row.gc_ms, row.idle_ms, row.lag_ms) == (3.5, 1.5, 0.0, 0.0)


def _log(tmp_path: Path, entries: list[tuple[str, int, float]]) -> Path:
    """A log of decode steps: (HH:MM:SS,fff, step number, run ms) each."""
    records = []
    for clock, step, run_ms in entries:
        plan = StepPlan(step=step, seqs=[SeqStep(None, 10, [0], slot=0)])
        records.append((clock, StepRecord(plan, schedule_ms=0.1, run_ms=run_ms, process_ms=0.05)))
    return _write_log(tmp_path, records)


def _write_log(tmp_path: Path, records: list[tuple[str, StepRecord]]) -> Path:
    """serve.log with each record's trace line as the engine logs it at its clock time."""
    lines = [
        f"2026-12-03 {clock} INFO [engine] m3serve.core.trace: {record.line()}"
        for clock, record in records
    ]
    log = tmp_path / "serve.log"
    log.write_text("\n".join(lines) + "\n")
    return log


def _one_row_decode(step: int, **fields: Any) -> StepRecord:
    """A decode step of one row planned in 0.1 ms and processed in 0.05, with `fields`."""
    plan = StepPlan(step=step, seqs=[SeqStep(None, 10, [0], slot=0)])
    return StepRecord(plan, schedule_ms=0.1, process_ms=0.05, **fields)


def test_gaps_are_between_consecutive_steps_and_windows_cut_by_clock(tmp_path: Path) -> None:
    log = _log(
        tmp_path,
        [
            ("16:00:00,000", 1, 2.0),
            ("16:00:00,002", 2, 2.0),
            ("16:00:00,010", 4, 2.0),
            ("16:00:00,019", 5, 9.0),
            ("16:00:01,000", 6, 2.0),
        ],
    )
    rows = steps(log)
    gaps = [(round(gap, 3), step.step) for gap, step in consecutive(rows)]
    assert gaps == [(2.0, 2), (9.0, 5), (981.0, 6)]  # step 4 follows no step 3
    assert [r.step for r in in_window(rows, "16:00:00.005", "16:00:01")] == [4, 5]
    assert [r.step for r in in_window(rows, None, "16:00:00.002")] == [1]


def test_percentile_takes_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0 and percentile(values, 0.5) == 50.0
    assert percentile([3.0], 0.99) == 3.0


def test_the_slowest_steps_are_listed_longest_gap_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _log(
        tmp_path,
        [
            ("16:00:00,000", 1, 2.0),
            ("16:00:00,002", 2, 2.0),
            ("16:00:00,009", 3, 7.0),
            ("16:00:00,012", 4, 3.0),
        ],
    )
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log), "--slowest", "2"])
    main()
    out = capsys.readouterr().out
    slowest = out.split("longest gaps from the step before\n")[1].splitlines()
    assert [line.split()[2] for line in slowest] == ["3", "4"]
    assert "gap    7.00 ms" in slowest[0]
    beyond = float(slowest[0].split("beyond run")[1].split()[0])
    assert beyond == pytest.approx(0.0, abs=0.01)  # step 3 ran its whole 7 ms gap
    assert "(idle 0.00, lag 0.00)" in slowest[0]


def _traced(tmp_path: Path, entries: list[tuple[Any, ...]]) -> Path:
    """A log of steps (number, mixed, run ms, lag ms[, decode rows: 1]) with 0.5 ms idle each,
    one line per ms."""
    records = []
    for i, (step, mixed, run_ms, lag_ms, *own) in enumerate(entries):
        seqs = [SeqStep(None, 10, [0], slot=r) for r in range(own[0] if own else 1)]
        if mixed:
            seqs.append(SeqStep([1, 2, 3], 0, [1], slot=1))
        record = StepRecord(
            StepPlan(step=step, seqs=seqs),
            schedule_ms=0.1,
            run_ms=run_ms,
            process_ms=0.05,
            idle_ms=0.5,
            lag_ms=lag_ms,
        )
        records.append((f"16:00:00,{i:03d}", record))
    return _write_log(tmp_path, records)


def test_token_gaps_add_the_run_and_the_change_of_lag(tmp_path: Path) -> None:
    # Tokens of step n reach the loop at end_n + lag_n; end_n = end_(n-1) + idle_n + run_n.
    log = _traced(
        tmp_path,
        [(1, False, 2.0, 1.0), (2, True, 4.0, 3.0), (3, True, 4.0, 1.0), (5, False, 2.0, 1.0)],
    )
    gaps = [(round(gap, 6), before.step, step.step) for gap, before, step in token_gaps(steps(log))]
    # step 5 follows no step 4: no gap
    assert gaps == [(0.5 + 4.0 + 3.0 - 1.0, 1, 2), (0.5 + 4.0 + 1.0 - 3.0, 2, 3)]


def test_the_itl_summary_names_the_steps_of_its_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = [(n, False, 2.0, 1.0) for n in range(1, 200)] + [(200, True, 6.0, 4.0)]
    log = _traced(tmp_path, entries)
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log), "--itl"])
    main()
    out = capsys.readouterr().out
    head, tail = out.split("--- inter-token gaps from the trace: ")[1].split("\n", 1)
    assert head.startswith("n=199 tokens in 199 steps p50 2.50 ")  # 0.5 idle + 2.0 run
    assert "p99 2.50 " in head  # one slow gap in 199 is past the 99th percentile
    rows = tail.splitlines()
    assert rows[0].split()[:3] == ["decode", "->", "decode"] and "n= 198" in rows[0]
    assert rows[1].split()[:3] == ["decode", "->", "mixed"] and "n=   1" in rows[1]
    assert "gap   9.50 ms = idle + run   6.50 + lag change  +3.00" in rows[1]


def test_itl_percentiles_count_a_gap_once_per_decode_row_that_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ten 1-row steps 1.5 ms apart, then three 16-row steps of 3.5: per step the median gap is
    1.5 ms, per token (what a client measures) 3.5; a mixed step's prompt row sees no gap."""
    entries = [(n, False, 1.0, 1.0, 1) for n in range(1, 12)]
    entries += [(n, False, 3.0, 1.0, 16) for n in range(12, 15)]
    log = _traced(tmp_path, [*entries, (15, True, 3.0, 1.0, 16)])
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log), "--itl"])
    main()
    head = capsys.readouterr().out.split("--- inter-token gaps from the trace: ")[1]
    assert head.startswith("n=74 tokens in 14 steps p50 3.50 ")  # 10 + 3 * 16 + 16
    assert percentile([g for g, _, _ in token_gaps(steps(log))], 0.5) == pytest.approx(1.5)


def test_weighted_percentile_repeats_each_value_its_weight() -> None:
    assert weighted_percentile([(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)], 0.5) == 2.0
    assert weighted_percentile([(5.0, 0), (1.0, 3), (9.0, 1)], 0.99) == 9.0
    assert weighted_percentile([(1.0, 3), (9.0, 1)], 0.5) == 1.0
    values = [float(v) for v in range(1, 101)]
    assert weighted_percentile([(v, 1) for v in values], 0.9) == percentile(values, 0.9)


def test_chunk_costs_bin_mixed_steps_by_decode_rows_and_prompt_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def plan(step: int, rows: int, chunk: int) -> StepPlan:
        seqs = [SeqStep(None, 10, [r], slot=r) for r in range(rows)]
        if chunk:
            seqs.append(SeqStep(list(range(chunk)), 0, [rows], slot=rows))
        return StepPlan(step=step, seqs=seqs)

    shapes = [(16, 0, 1.8), (16, 0, 2.0), (16, 40, 4.5), (15, 100, 4.4), (20, 70, 5.0)]
    records = [
        (f"16:00:00,{i:03d}", StepRecord(plan(i, rows, chunk), 0.1, run_ms=ms, process_ms=0.05))
        for i, (rows, chunk, ms) in enumerate(shapes)
    ]
    log = _write_log(tmp_path, records)
    costs = {key: [r.run_ms for r in group] for key, group in chunk_costs(steps(log)).items()}
    # 16 decode rows alone (bin -1), beside 40 prompt tokens (bin 0), 15 beside 100 (bin 1);
    # 20 rows fall in the next row bucket.
    assert costs == {(16, -1): [1.8, 2.0], (16, 0): [4.5], (16, 1): [4.4], (64, 1): [5.0]}
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log), "--chunk-cost"])
    main()
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "rows  <= 16  decode 1.90 (n 2)  0-63: 4.50 (n 1)  64-127: 4.40 (n 1)"
    assert out[-1] == "rows  <= 64  64-127: 5.00 (n 1)"


def test_long_collections_are_counted_by_generation_and_thread(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The engine's own `gc pause` line: a traced step with one collection, every one "long".
    monkeypatch.setattr(trace_module, "LONG_PAUSE_MS", 0.0)
    trace = StepTrace(log_every_step=True)
    try:
        trace.planned(StepPlan(step=3, seqs=[SeqStep(None, 10, [0], slot=0)]), 0.0)
        gc.collect(1)
        trace.ran(3, 0.001, trace.compiles.count)
        with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
            trace.processed(3, 0.0)
            trace.log_processed()
    finally:
        trace.close()
    pause = next(r.getMessage() for r in caplog.records if "gc pause" in r.getMessage())
    log = tmp_path / "serve.log"
    prefix = "2026-12-05 14:25:{} INFO [engine] m3serve.core.trace: "
    log.write_text("\n".join(prefix.format(f"{s:02d},000") + pause for s in (10, 11, 30)) + "\n")
    (first, *_) = gc_pauses(log)
    assert (first.generation, first.thread) == (1, "MainThread")
    assert len(in_window(gc_pauses(log), "14:25:11", "14:25:20")) == 1
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log)])
    main()
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("--- collections of 1 ms or more: 3, ")
    assert out[-1].startswith("generation 1 in MainThread: n=3 median ")


def test_steps_that_built_their_own_batch_are_counted_per_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    records = []
    for i, build_ms in enumerate((0.0, 0.8, 0.0, 1.2)):
        record = _one_row_decode(i + 1, run_ms=2.0, launch_ms=1.5, build_ms=build_ms)
        records.append((f"16:00:00,{2 * i:03d}", record))
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(_write_log(tmp_path, records))])
    main()
    (decode,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode")]
    assert "launch 1.50 (built in it: n 2, 1.00)" in decode


def test_the_slowest_steps_show_their_launch_beside_its_cpu_time_and_preemptions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose 22 ms launch got 1.5 ms of the executor thread's CPU and was preempted
    twice: the slowest list says so, next to a normal step's, with its device time."""
    records = []
    for i, (run, launch, cpu, preempted, device) in enumerate(
        ((2.0, 1.0, 0.9, 0, 1.9), (2.0, 1.0, 0.9, 0, 1.9), (24.0, 22.0, 1.5, 2, 21.5))
    ):
        record = StepRecord(
            StepPlan(step=i + 1, seqs=[SeqStep(None, 10, [0], slot=0)]),
            schedule_ms=0.1,
            run_ms=run,
            process_ms=0.05,
            launch_ms=launch,
            launch_cpu_ms=cpu,
            preempted=preempted,
            device_ms=device,
        )
        records.append((f"16:00:00,{(0, 3, 33)[i]:03d}", record))
    log = _write_log(tmp_path, records)
    parsed = [(r.launch_cpu_ms, r.preempted, r.device_ms) for r in steps(log)]
    assert parsed == [(0.9, 0, 1.9), (0.9, 0, 1.9), (1.5, 2, 21.5)]
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log), "--slowest", "1"])
    main()
    out = capsys.readouterr().out.splitlines()
    slowest = out[out.index("--- the 1 longest gaps from the step before") + 1]
    assert slowest.endswith("launch 22.00 (cpu 1.50)  preempted 2  device 21.50")


def test_the_wait_for_the_next_plan_and_its_launch_ahead_are_read_and_summarized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Decode steps that waited 0.7 ms for the plan after next and launched it in 0.5 ms
    (`wait=`, `ahead=`): parsed, and their medians over the steps that launched one ahead in
    the per-kind line; a step that launched nothing ahead logs neither."""
    records = []
    for i, (wait, ahead) in enumerate(((0.6, 0.5), (0.7, 0.5), (0.8, 0.5), (0.0, 0.0))):
        record = _one_row_decode(
            i + 1, run_ms=1.8, launch_ms=0.01, device_ms=0.9, wait_ms=wait, ahead_ms=ahead
        )
        records.append((f"16:00:00,{2 * i:03d}", record))
    log = _write_log(tmp_path, records)
    assert [(r.wait_ms, r.ahead_ms) for r in steps(log)] == [
        (0.6, 0.5), (0.7, 0.5), (0.8, 0.5), (0.0, 0.0)
    ]  # fmt: skip
    assert "ahead=" not in records[-1][1].line()
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log)])
    main()
    decode = next(line for line in capsys.readouterr().out.splitlines() if "decode" in line)
    assert "device  0.90 (wait 0.75 ahead 0.50)" in decode  # steps 2 and 3 (1 has no gap)


def test_each_launch_ahead_counts_for_the_kind_of_the_step_it_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step's `ahead=` is the launch of the step after it: decode, decode, mixed, decode,
    mixed, each launching the next, give mixed launches of 3.0 and 3.4 ms and decode ones of
    0.5 and 0.7 (the last step launched nothing)."""

    def mixed(step: int, ahead: float) -> StepRecord:
        seqs = [SeqStep(None, 10, [0], slot=0), SeqStep([1] * 64, 0, [1], slot=1)]
        record = StepRecord(StepPlan(step=step, seqs=seqs), 0.1, run_ms=3.5, process_ms=0.05)
        record.device_ms, record.wait_ms, record.ahead_ms = 3.4, 0.5, ahead
        return record

    def decode(step: int, ahead: float) -> StepRecord:
        return _one_row_decode(step, run_ms=1.3, device_ms=1.3, wait_ms=0.5, ahead_ms=ahead)

    made = [decode(1, 0.5), decode(2, 3.0), mixed(3, 0.7), decode(4, 3.4), mixed(5, 0.0)]
    log = _write_log(tmp_path, [(f"16:00:00,{2 * i:03d}", r) for i, r in enumerate(made)])
    assert launches_by_kind(steps(log)) == {"decode": [0.5, 0.7], "mixed": [3.0, 3.4]}
    monkeypatch.setattr("sys.argv", ["summarize_step_trace.py", str(log)])
    main()
    line = next(x for x in capsys.readouterr().out.splitlines() if "launched ahead" in x)
    assert line.endswith("decode median 0.60 ms (n 2), mixed median 3.20 ms (n 2)")


def test_the_allocators_lines_in_the_window_are_summed_by_steps(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lines the engine's AllocWatch writes (retried, new device memory) are read back."""
    counts = [0, 0]
    trace = StepTrace(log_every_step=True)
    trace.watch_allocator(lambda: (counts[0], counts[1]))
    every = trace_module.ALLOC_CHECK_EVERY
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        for step in range(1, 3 * every + 1):
            counts[1] += step in (3, every + 2, every + 3)
            counts[0] += step == 2 * every + 1
            trace.ran(step, 0.001, trace.compiles.count)
    stamps = ["16:00:00,100", "16:00:01,100", "16:00:09,100"]
    lines = [
        f"2026-12-03 {clock} INFO [engine] m3serve.core.trace: {record.getMessage()}"
        for clock, record in zip(stamps, caplog.records, strict=True)
    ]
    log = tmp_path / "serve.log"
    record = _one_row_decode(1, run_ms=1.0)
    log.write_text("\n".join([*lines, f"2026-12-03 16:00:00,000 INFO x: {record.line()}"]) + "\n")
    found = allocator_lines(log)
    assert [(a.kind, a.count, a.first, a.last) for a in found] == [
        ("took new device memory", 1, 1, every),
        ("took new device memory", 2, every + 1, 2 * every),
        ("retried", 1, 2 * every + 1, 3 * every),
    ]
    argv = ["summarize_step_trace.py", str(log), "--until", "16:00:05"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    out = capsys.readouterr().out
    assert f"CUDA allocations that took new device memory: 3 (by steps 1-{every}: 1, " in out
    assert "retried" not in out  # logged after the window
