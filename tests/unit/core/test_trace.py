"""The step trace (m3serve.core.trace): what kind each step is, the line it logs, and the
Triton compile counter behind the "compiled after ready" warning."""

from __future__ import annotations

import gc
import logging
import time

import pytest

import m3serve.core.trace as trace_module
from m3serve.core.trace import CompileCounter, StepRecord, StepTrace, step_kind, thread_usage
from m3serve.runtime.messages import SeqStep, StepPlan


def plan(*seqs: SeqStep, step: int = 1) -> StepPlan:
    return StepPlan(step=step, seqs=list(seqs))


DECODE = SeqStep(None, 9, [0, 1, 2])
PREFILL = SeqStep([5, 6, 7, 8], 0, [3])


def test_a_step_is_decode_prefill_or_mixed_by_its_seqs() -> None:
    assert step_kind(plan(DECODE, DECODE)) == "decode"
    assert step_kind(plan(PREFILL)) == "prefill"
    assert step_kind(plan(DECODE, PREFILL)) == "mixed"


def test_each_step_logs_its_kind_batch_tokens_and_times(caplog: pytest.LogCaptureFixture) -> None:
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, PREFILL, step=7), 0.001)
    trace.ran(7, 0.004, trace.compiles.count)
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        record = trace.processed(7, 0.002)
        assert not caplog.records  # logged apart: the overlap scheduler plans first
        trace.log_processed()
    assert record is not None and record.tokens == 5
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 7 mixed batch=2 tokens=5 host=3.00ms")
    assert "run=4.00ms" in line and "compiled" not in line
    trace.close()


def test_a_step_that_samples_logs_how_long_its_launch_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, step=3), 0.0)
    trace.ran(3, 0.004, trace.compiles.count, launch_seconds=0.003)
    trace.planned(plan(PREFILL, step=4), 0.0)
    trace.ran(4, 0.004, trace.compiles.count)  # samples nothing: no launch point
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        sampled, chunk = trace.processed(3, 0.0), trace.processed(4, 0.0)
        trace.log_processed()
    assert sampled is not None and sampled.launch_ms == pytest.approx(3.0)
    assert chunk is not None and chunk.launch_ms == 0.0
    first, second = (r.getMessage() for r in caplog.records)
    assert "run=4.00ms" in first and " launch=3.00ms" in first
    assert "launch=" not in second
    trace.close()


def test_a_step_that_built_its_own_batch_logs_how_long_that_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, step=5), 0.0)
    trace.ran(5, 0.004, trace.compiles.count, launch_seconds=0.003, build_seconds=0.0012)
    trace.planned(plan(DECODE, step=6), 0.0)
    trace.ran(6, 0.004, trace.compiles.count, launch_seconds=0.003)  # built ahead
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        trace.processed(5, 0.0)
        trace.processed(6, 0.0)
        trace.log_processed()
    late, ahead = (r.getMessage() for r in caplog.records)
    assert late.endswith(" launch=3.00ms build=1.20ms cpu=0.00ms")
    assert "build=" not in ahead
    trace.close()


def test_a_launch_logs_the_executor_threads_cpu_time_in_it_and_its_preemptions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 20 ms launch on 1.2 ms of the thread's CPU: the thread was kept from running, and
    preempted says whether by the OS; a step without a launch logs neither (nor a device time,
    which a step has only on a GPU, nor the wait for the next plan and its launch ahead)."""
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, step=5), 0.0)
    trace.ran(
        5, 0.022, trace.compiles.count, 0.020, 0.0, launch_cpu_seconds=0.0012, preempted=3,
        device_seconds=0.021, ahead=(0.0005, 0.0003),
    )  # fmt: skip
    trace.planned(plan(PREFILL, step=6), 0.0)
    trace.ran(6, 0.004, trace.compiles.count)  # a prompt chunk alone samples nothing
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        trace.processed(5, 0.0)
        trace.processed(6, 0.0)
        trace.log_processed()
    starved, chunk = (r.getMessage() for r in caplog.records)
    assert starved.endswith(
        " launch=20.00ms cpu=1.20ms preempted=3 device=21.00ms wait=0.50ms ahead=0.30ms"
    )
    assert "cpu=" not in chunk and "preempted=" not in chunk and "device=" not in chunk
    assert "ahead=" not in chunk
    trace.close()


def test_thread_usage_counts_this_threads_cpu_and_not_its_sleep() -> None:
    cpu, switches = thread_usage()
    time.sleep(0.05)
    slept_cpu, after_sleep = thread_usage()
    deadline = time.perf_counter() + 0.05
    while time.perf_counter() < deadline:  # busy: the thread's own CPU time
        pass
    busy_cpu, after_busy = thread_usage()
    assert slept_cpu - cpu < 0.02
    assert busy_cpu - slept_cpu > 0.02
    assert 0 <= switches <= after_sleep <= after_busy  # a running count


def test_idle_is_the_executors_wait_for_a_plan_and_lag_the_results_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sleeps stand for an event loop late to launch step 2 and late to process step 1; only
    lower bounds are checked (a sleep lasts at least as long as asked)."""
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, step=1), 0.0)
    trace.ran(1, 0.001, trace.compiles.count)  # the first run: nothing before it to wait on
    time.sleep(0.02)
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        first = trace.processed(1, 0.0)
        trace.log_processed()
    trace.planned(plan(DECODE, step=2), 0.0)
    trace.ran(2, 0.001, trace.compiles.count)
    second = trace.processed(2, 0.0)
    assert first is not None and second is not None
    assert first.idle_ms == 0.0 and first.lag_ms >= 19.0
    assert second.idle_ms >= 19.0
    assert " idle=0.00ms lag=" in caplog.records[0].getMessage()
    trace.close()


def test_a_mixed_step_logs_the_prompt_budget_it_was_held_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, PREFILL, step=8), 0.0, budget=256)
    trace.planned(plan(DECODE, step=9), 0.0, budget=256)  # a decode step: no prompt, no budget
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        trace.processed(8, 0.0)
        trace.processed(9, 0.0)
        trace.log_processed()
    mixed, decode = [r.getMessage() for r in caplog.records]
    assert mixed.endswith("budget=256") and "budget" not in decode
    trace.close()


def test_a_budget_sized_for_a_batch_still_filling_logs_that_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StepTrace(log_every_step=True)
    trace.planned(plan(DECODE, PREFILL, step=8), 0.0, budget=512, budget_rows=64)
    trace.planned(plan(DECODE, PREFILL, step=9), 0.0, budget=256, budget_rows=1)  # its own row
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        trace.processed(8, 0.0)
        trace.processed(9, 0.0)
        trace.log_processed()
    ahead, own = [r.getMessage() for r in caplog.records]
    assert ahead.endswith("budget=512(64 rows)") and own.endswith("budget=256")
    trace.close()


def test_a_step_that_compiled_is_a_warning_even_without_the_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StepTrace(log_every_step=False)
    trace.planned(plan(PREFILL, step=3), 0.0)
    before = trace.compiles.count
    trace.compiles._hook(fn=type("Fn", (), {"name": "_prefill_kernel"})())  # as Triton calls it
    trace.ran(3, 0.5, before)
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        trace.processed(3, 0.0)
        trace.log_processed()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "compiled 1: _prefill_kernel" in record.getMessage()
    trace.close()


def test_the_compile_counter_chains_to_and_restores_the_previous_hook() -> None:
    knobs = pytest.importorskip("triton").knobs
    seen: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        counter = CompileCounter()
        knobs.runtime.jit_post_compile_hook(fn=type("Fn", (), {"name": "k"})())
        assert counter.names == ["k"] and seen == ["k"]
        counter.close()
        assert knobs.runtime.jit_post_compile_hook is not counter._hook
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def traced_step(
    caplog: pytest.LogCaptureFixture, inside: int | None = None, before: int | None = None
) -> tuple[StepTrace, StepRecord, str]:
    """A traced step as one served, the first of its trace, with a collection of generation
    `inside` between its planning and processing and one of `before` ahead of its planning (as
    start-up's), and no other; the trace (closed), its record and its logged line."""
    trace = StepTrace(log_every_step=True)
    gc.disable()  # no collection may start on its own
    try:
        if before is not None:
            gc.collect(before)
        trace.planned(plan(DECODE, step=4), 0.0)
        if inside is not None:
            gc.collect(inside)
        trace.ran(4, 0.001, trace.compiles.count)
        with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
            record = trace.processed(4, 0.0)
            trace.log_processed()
    finally:
        gc.enable()
        trace.close()
    assert record is not None
    return trace, record, caplog.records[0].getMessage()


def test_a_step_logs_the_garbage_collections_that_ran_inside_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace, record, line = traced_step(caplog, inside=2)
    assert record.gc_ms > 0.0
    # A collection of the oldest generation is a full one: all of the pause counts as one.
    assert record.gc_full_ms == pytest.approx(record.gc_ms, abs=0.01)
    assert f"gc={record.gc_ms:.2f}ms(full {record.gc_full_ms:.2f})" in line
    assert trace.gc is not None and trace.gc._callback not in gc.callbacks


def test_only_collections_of_the_oldest_generation_count_as_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, record, line = traced_step(caplog, inside=0)  # a young collection: a pause, not a full one
    assert record.gc_ms > 0.0 and record.gc_full_ms == 0.0
    assert "(full" not in line


def test_a_long_collection_gets_a_line_of_its_own(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_module, "LONG_PAUSE_MS", 0.0)  # every collection is "long"
    gc.disable()  # only the step's own collection frees the cycles
    try:
        garbage = [[] for _ in range(100)]
        for item in garbage:
            item.append(item)  # cycles only a collection frees
        del garbage, item
        _, record, _ = traced_step(caplog, inside=1)
    finally:
        gc.enable()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gc pause")]
    assert len(lines) == 1, lines
    assert "generation 1" in lines[0] and "in thread MainThread" in lines[0]
    freed = int(lines[0].split(", ")[1].split()[0])
    assert freed >= 100
    assert f"gc pause {record.gc_ms:.2f} ms" in lines[0]  # the step's only collection


def test_collections_before_the_first_step_are_start_ups_and_get_no_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_module, "LONG_PAUSE_MS", 0.0)  # every collection is "long"
    traced_step(caplog, before=2)  # as the heap freeze before ready
    assert not [r for r in caplog.records if r.getMessage().startswith("gc pause")]


def test_short_collections_get_no_line_of_their_own(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_module, "LONG_PAUSE_MS", 1e9)  # no collection is "long"
    traced_step(caplog, inside=1)
    assert not [r for r in caplog.records if r.getMessage().startswith("gc pause")]


def test_a_step_without_a_collection_logs_no_gc_field(caplog: pytest.LogCaptureFixture) -> None:
    _, _, line = traced_step(caplog)
    assert "gc=" not in line


def test_retried_cuda_allocations_are_logged_with_the_steps_they_happened_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = [3, 40]  # the allocator's running counts: start-up's are not logged
    trace = StepTrace(log_every_step=True)
    trace.watch_allocator(lambda: (counts[0], counts[1]))
    every = trace_module.ALLOC_CHECK_EVERY
    with caplog.at_level(logging.INFO, logger="m3serve.core.trace"):
        for step in range(1, every + 1):  # nothing in the first window
            trace.ran(step, 0.001, trace.compiles.count)
        for step in range(every + 1, 2 * every + 1):
            if step == every + 5:
                counts[0] = 5
            trace.ran(step, 0.001, trace.compiles.count)
        for step in range(2 * every + 1, 3 * every + 1):
            if step == 2 * every + 9:
                counts[1] = 43
            trace.ran(step, 0.001, trace.compiles.count)
    retried, taken = [r.getMessage() for r in caplog.records]
    assert retried.startswith("CUDA allocator: 2 allocations retried")
    assert retried.endswith(f"in steps {every + 1}-{2 * every}")
    assert taken.startswith("CUDA allocator: 3 allocations took new device memory")
    assert taken.endswith(f"in steps {2 * every + 1}-{3 * every}")


def test_the_allocator_is_not_read_without_the_trace() -> None:
    def read() -> int:
        raise AssertionError("read without the trace")

    trace = StepTrace(log_every_step=False)
    trace.watch_allocator(read)
    for step in range(1, 2 * trace_module.ALLOC_CHECK_EVERY):
        trace.ran(step, 0.001, trace.compiles.count)
    assert trace.alloc is None
