"""The mixed-step budget kept to its stretch by served steps (core/mixed_budget.py), and what
the step loop feeds it."""

from __future__ import annotations

import logging
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from m3serve.core.mixed_budget import SCALE_MIN, MixedBudget
from m3serve.core.prefill_demand import MIN_REQUESTS, PrefillDemand
from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.core.step_cost import StepCost
from m3serve.core.step_loop import _feed
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import PageCopy, SamplingParams, SeqStep, StepPlan, StepResult

PAGE = 128
# Near the start-up measure of a 4-layer H200 slice (12-03: decode steps, 6.8 us a prompt token,
# 0.71 ms fixed), which gave 16 decode rows a budget of 384 tokens.
START = StepCost({1: 1.63, 16: 2.25, 64: 2.98}, 0.0068, 0.71)


def served_ms(decodes: int, tokens: int) -> float:
    """Served mixed steps of that slice (bench_mixed_step, 12-03): 2.85 ms + 8.75 us a decode
    row + 6.85 us a prompt token; served decode steps of 16 rows 1.99 ms."""
    return 2.85 + 0.00875 * decodes + 0.00685 * tokens


def serve(budget: MixedBudget, decodes: int, steps: int, decode_ms: float) -> None:
    """Steps as a busy server runs them: a decode step, then a mixed step carrying the budget."""
    for _ in range(steps):
        budget.observe(decodes, 0, decode_ms)
        tokens = budget(decodes)
        budget.observe(decodes, tokens, served_ms(decodes, tokens))


def test_the_budget_starts_at_the_start_up_measure() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    assert budget(16) == START.mixed_budget(16, 2.5, PAGE) == 384


def test_served_steps_bring_the_budget_to_where_mixed_steps_take_stretch_decode_steps() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    serve(budget, 16, 60, decode_ms=1.99)
    tokens = budget(16)
    # 2.5 x 1.99 ms holds 2.85 + 0.14 + 0.00685 x 292: at most 292 tokens, 256 in whole pages.
    assert tokens == 256
    assert served_ms(16, tokens) <= 2.5 * 1.99 < served_ms(16, tokens + PAGE)
    assert budget.decode_ms[16] < 2.0  # the served decode step replaced the start-up one


def test_a_tight_stretch_takes_the_budget_below_a_page_in_quanta() -> None:
    """With stretch 1.8 one page of prompt already overruns (3.87 ms against 3.58): the budget
    steps down 32 tokens at a time to the most that fit, 64, where a page floor would have kept
    every mixed step over the stretch."""
    budget = MixedBudget(START, 1.8, 32)
    serve(budget, 16, 100, decode_ms=1.99)
    tokens = budget(16)
    assert tokens == 64
    assert served_ms(16, tokens) <= 1.8 * 1.99 < served_ms(16, tokens + 32)


def test_a_step_just_over_the_stretch_takes_a_page_off_at_once() -> None:
    """The served steps run 0.2 % over the stretch at the budget's 3 pages: the work ratio
    alone would shave 0.1 % a step off a budget 20 % above its page boundary, leaving the
    mixed steps over the stretch for ~180 steps; the page floor moves it at once."""
    start = StepCost({16: 1.25}, 0.002, 1.0)  # 384 tokens at the start-up measure
    budget = MixedBudget(start, 2.5, PAGE)
    budget.decode_ms[16] = 1.176  # as after many served decode steps
    budget.scale[16] = 1.2  # 461 tokens before the cut to whole pages
    assert budget(16) == 384
    budget.observe(16, 384, 1.176 + 1.0 + 0.002 * 384)  # 2.944 ms against 2.5 x 1.176 = 2.94
    assert budget(16) == 256


def flat_ms(tokens: int) -> float:
    """Served mixed steps of the 12-05 H100 slice beside 16 decode rows: ~4.6 ms whatever the
    chunk up to a few hundred tokens (a fixed part that alone fills the stretch)."""
    return 4.6 + 0.0005 * tokens


def test_where_the_fixed_cost_fills_the_stretch_the_floor_keeps_chunks_whole() -> None:
    # Every mixed step runs over 2.5 x 1.83 = 4.575 ms: without a floor the budget walks down
    # to one quantum (chunks 8x smaller, no faster); with one it stays there.
    start = StepCost({16: 1.83}, 0.007, 1.5)  # the start-up fit: 160 tokens
    plain = MixedBudget(start, 2.5, 32)
    floored = MixedBudget(start, 2.5, 32, min_tokens=256)
    for budget in (plain, floored):
        for _ in range(100):
            budget.observe(16, 0, 1.83)
            budget.observe(16, budget(16), flat_ms(budget(16)))
    assert plain(16) == 32
    assert floored(16) == 256


def test_the_floor_is_whole_quanta_and_a_budget_above_it_still_follows_the_stretch() -> None:
    budget = MixedBudget(START, 2.5, PAGE, min_tokens=200)
    assert budget.floor == PAGE  # 200 tokens cut to whole pages
    serve(budget, 16, 60, decode_ms=1.99)
    assert budget(16) == 256  # as without a floor (the stretch test above)


def test_a_budget_too_small_grows_back() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    budget.scale[64] = SCALE_MIN  # as after a burst of slow steps
    serve(budget, 64, 60, decode_ms=2.98)
    # 2.5 x 2.98 ms = 7.45 ms holds 2.85 + 0.56 + 0.00685 x 589 tokens: 512 in whole pages.
    assert budget(64) == 512


def test_short_chunks_do_not_grow_the_budget() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    before = budget(64)
    for _ in range(20):  # prompt tails of one page: cheap, and no sign the budget is tight
        budget.observe(64, PAGE, served_ms(64, PAGE))
    assert budget(64) == before


def test_one_slow_step_moves_the_budget_one_damped_step_only() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    before = budget(64)
    budget.observe(64, budget(64), 50.0)  # a garbage collection inside the step
    assert budget(64) >= 0.8 * before - PAGE


@settings(max_examples=60, deadline=None)
@given(
    decodes=st.integers(1, 200),
    tokens=st.integers(0, 4096),
    ms=st.floats(0.0, 100.0, allow_nan=False),
)
def test_the_budget_is_always_whole_pages_and_at_least_one(
    decodes: int, tokens: int, ms: float
) -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    for _ in range(30):
        budget.observe(decodes, tokens, ms)
    value = budget(decodes)
    assert value >= PAGE and value % PAGE == 0
    assert value <= 4 * max(START.mixed_budget(decodes, 2.5, PAGE), PAGE)


class _Seen:
    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []

    def observe(self, decodes: int, prompt: int, ms: float, sized_for: int = 0) -> None:
        self.steps.append((decodes, prompt, ms, sized_for))


def test_the_loop_feeds_decode_rows_and_prompt_tokens_of_plain_steps_only() -> None:
    seen = _Seen()
    decode = SeqStep(None, 100, [0], slot=0)
    chunk = SeqStep(list(range(300)), 0, [1, 2, 3], slot=1, sample=False)
    _feed(seen, StepPlan(step=1, seqs=[decode, decode, chunk]), 0.004)  # type: ignore[arg-type]
    verify = SeqStep(None, 100, [0], slot=0, draft=3)
    _feed(seen, StepPlan(step=2, seqs=[verify, chunk]), 0.004)  # type: ignore[arg-type]
    load = StepPlan(step=3, seqs=[decode, chunk], loads=[PageCopy(1, [4], [0])])
    _feed(seen, load, 0.004)  # type: ignore[arg-type]
    _feed(seen, StepPlan(step=4, seqs=[decode, chunk]), 0.004, sized_for=16)  # type: ignore[arg-type]
    assert seen.steps == [(2, 300, 4.0, 0), (1, 300, 4.0, 16)]


def test_a_step_sized_for_a_batch_still_filling_is_judged_as_that_batchs_step() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    budget.decode_ms[64] = 2.98
    tokens = budget(64)
    # 16 rows carried the 64-row budget: alone they ran well inside 16 rows' stretch, but with
    # the 48 rows they lacked (+0.73 ms) the step is past 64 rows' 7.45 ms: the 64 bucket's
    # budget comes down, and the 16 bucket's, which this step did not carry, stays.
    budget.observe(16, tokens, 7.0, sized_for=64)
    assert budget.scale[64] < 1.0
    assert budget.scale[16] == 1.0
    # The same step judged by its own rows would have been far over 16 rows' stretch.
    own = MixedBudget(START, 2.5, PAGE)
    own.observe(16, tokens, 7.0)
    assert own.scale[16] < 1.0


def test_slow_decode_steps_do_not_raise_the_decode_mean_past_a_fifth_a_step() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    budget.observe(16, 0, 2.0)
    budget.observe(16, 0, 2.0)
    before = budget.decode_ms[16]
    budget.observe(16, 0, 40.0)  # a decode step stalled by a collection
    assert budget.decode_ms[16] <= before * (1 + 0.1 * 0.2) + 1e-9


def test_a_budget_a_page_short_of_the_stretch_holds_when_the_page_would_leave_no_margin() -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    budget.decode_ms[16] = 2.0  # limit 5 ms
    before = budget(16)
    # Its whole budget in 4.2 ms: one more page (0.87 ms) would be 5.07 ms, past the stretch.
    budget.observe(16, before, 4.2)
    assert budget.scale[16] == 1.0


def test_a_bucket_served_rarely_takes_the_decode_step_of_a_bigger_bucket() -> None:
    noisy = StepCost({1: 1.37, 12: 2.27, 16: 1.98, 64: 2.85}, 0.0069, 0.71)
    budget = MixedBudget(noisy, 2.5, PAGE)
    assert budget(12) == budget(16) == 256  # not the 384 that 2.27 ms would give
    for _ in range(30):  # served decode steps of 13-16 rows, none of 9-12
        budget.observe(16, 0, 2.16)
    budget.observe(12, 256, 5.45)  # a mixed step of 12 rows: past 2.5 x the 16 bucket's step
    assert budget.scale[12] < 1.0


def test_the_budgets_are_logged_when_they_move(caplog: pytest.LogCaptureFixture) -> None:
    budget = MixedBudget(START, 2.5, PAGE)
    with caplog.at_level(logging.INFO, logger="m3serve.core.mixed_budget"):
        serve(budget, 16, 10, decode_ms=1.99)  # 384 -> 256: one line
        serve(budget, 16, 10, decode_ms=1.99)  # settled: no more
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.search(r"16: 2\.0\d ms -> 256,", line)  # the served decode mean, on its way to 1.99


@settings(max_examples=100, deadline=None)
@given(
    fixed=st.floats(0.2, 3.0),
    per_token=st.floats(0.002, 0.012),
    decode=st.floats(1.0, 4.0),
    start_error=st.floats(0.7, 1.4),
)
def test_served_steps_settle_on_pages_that_fit_the_stretch_with_one_more_not_fitting(
    fixed: float, per_token: float, decode: float, start_error: float
) -> None:
    """Served steps cost decode + fixed + per_token x tokens; the start-up measure got the
    decode step wrong by `start_error`. The budget ends inside the stretch, and a page more
    would not be (within the 5 % margin), wherever it started."""
    start = StepCost({16: decode * start_error}, per_token, fixed)
    budget = MixedBudget(start, 2.5, PAGE)
    limit = 2.5 * decode
    best = (limit - decode - fixed) / per_token  # prompt tokens that exactly fill the stretch
    begin = budget(16)
    assume(best >= 2 * PAGE and begin / 8 <= best <= 4 * begin)
    for _ in range(200):
        budget.observe(16, 0, decode)
        tokens = budget(16)
        budget.observe(16, tokens, decode + fixed + per_token * tokens)
    tokens = budget(16)
    assert decode + fixed + per_token * tokens <= limit
    assert decode + fixed + per_token * (tokens + PAGE) > 0.95 * limit


def test_a_bucket_no_decode_step_corrected_moves_as_the_nearest_corrected_one_did() -> None:
    budget = MixedBudget(StepCost({16: 2.0, 64: 3.0, 128: 4.0}, 0.0068), 2.5, PAGE)
    assert budget.served_means() == {16: 2.0, 64: 3.0, 128: 4.0}  # nothing served yet
    for _ in range(200):
        budget.observe(64, 0, 2.0)  # served 64-row steps run two thirds of the start-up time
    means = budget.served_means()
    assert means[64] == pytest.approx(2.0, rel=1e-3)
    assert means[128] == pytest.approx(4.0 * 2 / 3, rel=1e-3)
    assert means[16] == pytest.approx(2.0 * 2 / 3, rel=1e-3)
    for _ in range(200):
        budget.observe(16, 0, 1.0)
    # Its own steps now: 16 keeps its mean; 128's nearest corrected bucket is still 64.
    assert budget.served_means()[16] == pytest.approx(1.0, rel=1e-3)
    assert budget.served_means()[128] == pytest.approx(4.0 * 2 / 3, rel=1e-3)


def test_the_first_mixed_steps_of_a_bucket_never_served_are_judged_by_the_served_pace() -> None:
    # Served 16-row decode steps ran at half their start-up time; no 64-row one has run. A
    # 64-row mixed step of 6 ms is within 2.5 x 2.98 ms at the start-up pace, but past
    # 2.5 x 1.49 at the served one: its budget comes down.
    budget = MixedBudget(START, 2.5, PAGE)
    for _ in range(200):
        budget.observe(16, 0, 2.25 / 2)
    tokens = budget(64)
    budget.observe(64, tokens, 6.0)
    assert budget.scale[64] < 1.0
    assert "64: 1.49 ms" in str(budget)


def test_a_demand_caps_the_budget_at_what_the_batch_consumes_and_leaves_the_scale() -> None:
    """1184-token prompts and 256 outputs with a margin of 1.2: 16 rows consume 74 prompt
    tokens a step, so the budget is 96 (3 quanta), not the stretch's 384; the cap grows with
    the rows (64: 384). Steps held to the cap do not move the stretch's scale, so the budget is
    the stretch's again once the cap lifts."""
    demand = PrefillDemand(1.2)
    budget = MixedBudget(START, 2.5, 32, demand=demand)
    uncapped = budget(16), budget(64)
    for _ in range(MIN_REQUESTS):
        demand.note(1184, 256)
    assert budget(16) == 96 and uncapped[0] > 96
    assert budget(64) == min(uncapped[1], 384) == 384
    scale = dict(budget.scale)
    for _ in range(50):  # short, cheap steps at the cap: room for more, but capped
        budget.observe(16, 0, 1.99)
        budget.observe(16, 96, 2.2)
    assert budget.scale == scale


def test_finished_requests_tell_the_demand_the_prompt_they_computed() -> None:
    """A request whose prompt was partly cached counts the tokens computed, once it ends."""
    demand = PrefillDemand(1.0)
    scheduler = Scheduler(SchedArgs(max_running_requests=2), 64, 4, radix=True, demand=demand)
    prompt = list(range(1, 41))
    for rid in ("a", "b"):
        sampling = SamplingParams(max_new_tokens=3, temperature=0.0)
        req = Req(rid=rid, prompt=prompt, sampling=sampling, stop_ids=frozenset(), worker=0)
        scheduler.add(req)
        while scheduler.has_work:
            plan = scheduler.schedule()
            assert plan is not None
            sampled = [seq.slot for seq in plan.seqs if seq.sample]
            scheduler.process(StepResult(step=plan.step, slots=sampled, tokens=[7] * len(sampled)))
    # "a" computed its 40 prompt tokens; "b" found 36 of them cached (whole pages, not the last).
    assert demand.requests == 2
    assert demand.prompt == pytest.approx((40 + 4) / 2)
    assert demand.output == pytest.approx(3)
