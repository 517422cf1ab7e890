"""The mixed-step prompt budget from measured step times, and the synthetic steps that measure
them (valid batches over the unused pool)."""

from __future__ import annotations

import pytest

from m3serve.core.step_cost import StepCost, budget_quantum, fit_per_token, measure_step_cost
from m3serve.model.batch import ForwardBatch
from m3serve.runtime.messages import SeqStep

COST = StepCost({1: 2.0, 16: 2.5, 64: 4.0}, prefill_ms_per_token=0.01)


def test_a_mixed_step_may_add_stretch_minus_one_decode_steps_of_prompt_work() -> None:
    # (2.5 - 1) * 2.5 ms = 3.75 ms of prompt work = 375 tokens -> 256 in whole 128-token pages.
    assert COST.mixed_budget(16, 2.5, 128) == 256
    assert COST.mixed_budget(9, 2.5, 128) == 256  # the 16 bucket's time
    assert COST.mixed_budget(64, 2.5, 128) == 512  # 6 ms -> 600 tokens
    # Past the largest bucket: 4 ms + (4 - 2.5) / 48 ms a row more = 8.25 ms -> 1237 tokens.
    assert COST.mixed_budget(200, 2.5, 128) == 1152


def test_past_the_largest_batch_a_decode_step_grows_along_the_last_measured_slope() -> None:
    assert COST.decode(64) == 4.0
    assert COST.decode(128) == pytest.approx(4.0 + 64 * 1.5 / 48)
    # A largest batch timed faster than the one before it (noise) adds nothing a row.
    flat = StepCost({16: 2.5, 64: 2.0}, prefill_ms_per_token=0.01)
    assert flat.decode(256) == 2.0
    assert StepCost({8: 1.0}, 0.01).decode(100) == 1.0  # one size: no slope to follow


def test_the_fixed_cost_of_a_mixed_step_comes_off_its_prompt_work() -> None:
    # 3.75 ms of stretch at batch 16, 1.5 ms of it spent leaving the decode graph: 225 tokens.
    fixed = StepCost(COST.decode_ms, prefill_ms_per_token=0.01, mixed_fixed_ms=1.5)
    assert fixed.mixed_budget(16, 2.5, 128) == 128
    assert fixed.mixed_budget(64, 2.5, 128) == 384  # 6 - 1.5 ms -> 450 tokens
    # More fixed cost than stretch: still one page, so prompts advance.
    assert StepCost({1: 1.0}, 0.01, mixed_fixed_ms=5.0).mixed_budget(1, 2.5, 128) == 128
    assert "1.50 ms fixed per mixed step" in fixed.describe(2.5, 128)


def test_the_budget_is_never_below_one_page() -> None:
    slow = StepCost({1: 0.1}, prefill_ms_per_token=1.0)
    assert slow.mixed_budget(1, 1.5, 128) == 128


def test_the_per_token_cost_is_the_slope_not_the_mean() -> None:
    # 1 ms of fixed launch cost plus 0.02 ms per token.
    samples = {n: 1.0 + 0.02 * n for n in (256, 512, 1024)}
    assert fit_per_token(samples) == pytest.approx(0.02)
    assert fit_per_token({100: 5.0}) == pytest.approx(0.05)


def test_a_pool_too_small_for_the_mixed_probe_measures_no_fixed_cost() -> None:
    cost = measure_step_cost(lambda seqs: None, lambda: None, [1, 8, 64], 128, 9, 2048, 512)
    assert cost.mixed_fixed_ms == 0.0


def test_the_measured_steps_are_valid_batches_over_distinct_pages() -> None:
    steps: list[list[SeqStep]] = []

    def forward(seqs: list[SeqStep]) -> None:
        ForwardBatch.build(seqs, 128, "cpu")  # raises on a malformed step
        pages = [p for s in seqs for p in s.pages]
        assert len(pages) == len(set(pages)) and max(pages) < 300
        steps.append(seqs)

    cost = measure_step_cost(forward, lambda: None, [1, 8, 64], 128, 300, 2048, 512)
    assert sorted(cost.decode_ms) == [1, 8, 64]
    assert cost.prefill_ms_per_token > 0 and cost.mixed_fixed_ms >= 0
    decode_rows = {len(seqs) for seqs in steps if all(s.extend == 1 for s in seqs)}
    assert decode_rows == {1, 8, 64}
    # The mixed probe: a two-page chunk beside the middle batch size's decode rows.
    mixed = [seqs for seqs in steps if len(seqs) > 1 and seqs[0].extend > 1]
    assert mixed and all(len(seqs) == 9 and seqs[0].extend == 256 for seqs in mixed)
    assert all(s.extend == 1 for s in mixed[0][1:])
    assert {seqs[0].extend for seqs in steps if len(seqs) == 1 and seqs[0].extend > 1} == {
        256,
        512,
        1024,
        2048,
    }
    # Rows of one step carry different tokens (one token everywhere routes every row alike).
    for seqs in steps:
        tokens = [t for s in seqs for t in s.input_ids or []]
        assert all(0 <= t < 512 for t in tokens)
        assert len(set(tokens)) == min(len(tokens), 512)


def test_a_smaller_batch_timed_slower_than_a_bigger_one_counts_as_the_bigger_one() -> None:
    # The H200's start-up measure once had 12 rows at 2.27 ms and 16 at 1.98 ms: noise.
    noisy = StepCost({8: 2.11, 12: 2.27, 16: 1.98, 64: 2.85}, prefill_ms_per_token=0.0069)
    assert noisy.decode(12) == noisy.decode(16) == 1.98
    assert noisy.decode(9) == 1.98 and noisy.decode(4) == 1.98
    assert noisy.decode(64) == 2.85
    assert noisy.mixed_budget(12, 2.5, 128) == noisy.mixed_budget(16, 2.5, 128)


def test_the_budget_steps_by_quanta_of_32_tokens_not_by_pages() -> None:
    # 375 tokens of prompt work: 352 in quanta of 32, where whole pages held 256.
    assert budget_quantum(128) == 32
    assert COST.mixed_budget(16, 2.5, budget_quantum(128)) == 352
    assert budget_quantum(16) == 16  # a page smaller than a quantum is the step
