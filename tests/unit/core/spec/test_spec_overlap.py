"""Speculative decoding under the overlap scheduler, through the engine core: step N+1 is planned
and launched before step N's verdict is processed, so its verify rows start where the executor
thread knows step N left them; what is checked here is that this really happens (planned starts
corrected, rows of requests that stopped inside step N's block dropped) and that it changes no
greedy token, against speculation run serially and no speculation at all."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.core.scheduler import Outputs, Scheduler
from m3serve.core.spec.lengths import SlotLengths
from m3serve.core.step_runner import StepRunner
from m3serve.runtime.messages import SKIPPED_TOKEN, SamplingParams, SeqStep, StepResult

from .engine_runs import DSPARK, PROMPTS, agreeing, at_baseline, generate, request


def _spy_corrections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How far past its planned start each decode or verify row the executor ran started."""
    shifts: list[int] = []
    resolve = SlotLengths.resolve

    def spy(self: SlotLengths, seqs: Sequence[SeqStep]) -> list[SeqStep]:
        resolved = resolve(self, seqs)
        for planned, seq in zip(seqs, resolved, strict=True):
            if planned.input_ids is None:
                shifts.append(seq.start - planned.start)
        return resolved

    monkeypatch.setattr(SlotLengths, "resolve", spy)
    return shifts


def _spy_results(monkeypatch: pytest.MonkeyPatch) -> list[StepResult]:
    results: list[StepResult] = []
    process = Scheduler.process

    def spy(self: Scheduler, result: StepResult) -> Outputs:
        results.append(result)
        return process(self, result)

    monkeypatch.setattr(Scheduler, "process", spy)
    return results


def test_verify_rows_planned_one_verdict_behind_start_where_it_left_them(
    cores, monkeypatch: pytest.MonkeyPatch
) -> None:
    off, serial, overlapped = cores(), cores(**DSPARK), cores(**DSPARK)
    agreeing(serial)
    agreeing(overlapped)
    reqs = lambda: [request(str(i), p) for i, p in enumerate(PROMPTS)]  # noqa: E731
    want = generate(off, reqs())
    assert generate(serial, reqs()).outputs == want.outputs
    shifts = _spy_corrections(monkeypatch)
    got = generate(overlapped, reqs(), overlap=True)
    assert got.outputs == want.outputs
    # The agreeing draft gets blocks accepted: a row planned before that verdict starts later.
    assert max(shifts) > 0, "no verify row was planned while the previous one was in flight"
    assert max(shifts) <= overlapped.spec.settings.block_size  # type: ignore[union-attr]
    at_baseline(overlapped)


def test_every_step_that_samples_reports_its_launch(cores, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify steps too tell the runner once their kernels are queued (the executor hands the
    previous step's result over there; core/executor.py)."""
    on = cores(**DSPARK)
    agreeing(on)
    launches: list[int] = []
    launched = StepRunner.launched

    def spy(self: StepRunner) -> None:
        launches.append(1)
        launched(self)

    monkeypatch.setattr(StepRunner, "launched", spy)
    results = _spy_results(monkeypatch)
    generate(on, [request(str(i), p) for i, p in enumerate(PROMPTS)], overlap=True)
    sampled = [r for r in results if any(t != SKIPPED_TOKEN for t in r.tokens)]
    assert len(launches) >= len(sampled) > 0
    at_baseline(on)


def test_accept_length_override_under_overlap_shifts_every_row_by_its_drafts(
    cores, monkeypatch: pytest.MonkeyPatch
) -> None:
    on = cores(speculative_accept_length_override=3, **DSPARK)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0)
    shifts = _spy_corrections(monkeypatch)
    got = generate(on, [request(str(i), p, sampling) for i, p in enumerate(PROMPTS)], overlap=True)
    for rid, steps in got.accepted.items():
        assert steps and all(n == 3 for n in steps), rid
        assert len(got.outputs[rid]) == 20
    # Each row planned one verdict behind lags by that verdict's 2 accepted drafts, exactly.
    assert set(shifts) <= {0, 2} and 2 in shifts
    at_baseline(on)


def test_a_stop_inside_a_block_drops_the_row_launched_after_it(
    cores, monkeypatch: pytest.MonkeyPatch
) -> None:
    off, on = cores(), cores(**DSPARK)
    agreeing(on)
    probe = generate(off, [request("p", PROMPTS[2])]).outputs["p"]
    stop = probe[6]
    cut = probe.index(stop) + 1
    results = _spy_results(monkeypatch)
    got = generate(on, [request("s", PROMPTS[2], stops=[stop])], overlap=True)
    assert got.outputs["s"] == probe[:cut]  # not a token past the stop
    assert any(SKIPPED_TOKEN in r.tokens for r in results), "no step was launched after it"
    at_baseline(on)


def test_mixed_batches_with_chunks_prefix_hits_retraction_and_aborts_match(cores) -> None:
    # 16 pages of 4 tokens, chunks of 8: the requests outgrow the pool (retraction); a second
    # wave extends the first wave's prompts (prefix hits); one is aborted mid-way. Penalized and
    # logprobs requests decode one token per step beside the verify rows; a seeded sampled one
    # runs with them (its tokens are its own, not compared).
    kwargs = {"max_total_tokens": 64, "chunked_prefill_size": 8}
    prompts = [list(range(9, 9 + n)) for n in (6, 11, 17)]
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0)
    penalized = SamplingParams(max_new_tokens=10, temperature=0.0, repetition_penalty=1.3)
    logprobs = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=40, seed=3)

    def waves() -> list[list[Req]]:
        first = [request(f"g{i}", p, greedy) for i, p in enumerate(prompts)]
        first += [
            request("pen", prompts[1], penalized),
            request("lp", prompts[2], logprobs),
            request("smp", prompts[0], sampled),
        ]
        second = [request(f"h{i}", [*p, 300 + i], greedy) for i, p in enumerate(prompts)]
        return [first, second]

    def run(core: EngineCore, overlap: bool) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        for wave in waves():
            got = generate(core, wave, abort_after={"g1": 5}, overlap=overlap)
            outputs.update(got.outputs)
        return outputs

    off = cores(**kwargs)
    serial, overlapped = cores(**kwargs, **DSPARK), cores(**kwargs, **DSPARK)
    agreeing(overlapped)  # long accepted blocks: the worst-case page reservations bite
    want, plain, got = run(off, False), run(serial, False), run(overlapped, True)
    assert overlapped.scheduler.retracted > 0, "the pool was large enough: nothing was retracted"
    assert overlapped.scheduler.cached_prompt_tokens > 0, "the second wave hit no cached prefix"
    for rid in want:
        if rid == "smp":
            assert len(got[rid]) == 10
        elif rid == "g1":  # aborted once it had 5 tokens, in every run: prefixes of one output
            n = min(len(got[rid]), len(want[rid]), len(plain[rid]))
            assert n >= 5 and len(got[rid]) < 14
            assert got[rid][:n] == want[rid][:n] == plain[rid][:n]
        else:
            assert got[rid] == want[rid] == plain[rid], rid
    at_baseline(overlapped)
    at_baseline(serial)
