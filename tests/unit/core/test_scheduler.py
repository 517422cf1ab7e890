"""The scheduler against a model-free stand-in whose tokens depend on the KV it reads back:
continuous batching, chunked prefill, prefix caching, retraction, aborts and overlap all have to
reproduce each request's solo output, and every page comes back when the work is done."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from m3serve.core.req import Req
from m3serve.core.scheduler import QueueFull, Scheduler
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import SamplingParams, StepPlan

from .fake_model import FakeModel, reference_output

PAGE = 4
STOP = frozenset({7})


@dataclass
class Run:
    scheduler: Scheduler
    model: FakeModel
    outputs: dict[str, list[int]]
    finishes: dict[str, str]


def make(num_pages: int, radix: bool = True, deltas: bool = False, **sched: float | str) -> Run:
    """`deltas`: rows carry page-list changes only, as the engine core's scheduler sends them."""
    args = SchedArgs(**{"max_running_requests": 8, "max_prefill_tokens": 64, **sched})
    scheduler = Scheduler(args, num_pages, PAGE, radix, page_deltas=deltas)
    model = FakeModel(num_pages, PAGE, args.max_running_requests, deltas=deltas)
    return Run(scheduler, model, {}, {})


def request(rid: str, prompt: list[int], max_new: int) -> Req:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    return Req(rid, prompt, sampling, STOP, worker=0)


def drive(
    run: Run,
    overlap: bool = True,
    aborts: dict[int, str] | None = None,
    arrivals: list[tuple[int, Req]] | None = None,
) -> None:
    """Run to completion, one schedule call per tick; requests arrive and aborts land at given
    ticks. With overlap, step N+1 is planned before step N's result lands."""
    pending: deque[StepPlan] = deque()
    aborts = dict(aborts or {})
    arrivals = sorted(arrivals or [], key=lambda item: item[0])
    for tick in range(10_000):
        while arrivals and arrivals[0][0] <= tick:
            run.scheduler.add(arrivals.pop(0)[1])
        if tick in aborts:
            run.scheduler.abort(aborts.pop(tick))
        plan = run.scheduler.schedule()
        if plan is not None:
            pending.append(plan)
        if pending and (len(pending) > 1 or not overlap or plan is None):
            collect(run, pending.popleft())
        run.scheduler.idle_check()
        if not arrivals and not pending and not run.scheduler.has_work:
            return
    raise AssertionError("the scheduler did not finish the workload")


def collect(run: Run, plan: StepPlan) -> None:
    out = run.scheduler.process(run.model.run(plan))
    for batch in out.batches.values():
        for rid, ids, finish in zip(batch.rids, batch.new_ids, batch.finish, strict=True):
            run.outputs.setdefault(rid, []).extend(ids)
            if finish is not None:
                run.finishes[rid] = finish.reason


def assert_all_pages_back(run: Run) -> None:
    s = run.scheduler
    s.idle_check()
    assert not s.running and not s.waiting
    assert s.slots.num_free == s.slots.num_slots
    s.cache.reset()
    assert s.pool.num_free == s.pool.num_pages


def prompts(seed: int, count: int, low: int = 1, high: int = 40) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(8, 1000) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.mark.parametrize("deltas", [False, True], ids=["whole-lists", "page-deltas"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("chunk", [-1, 5], ids=["whole-prefill", "chunk-5"])
def test_batched_outputs_equal_solo_outputs(overlap: bool, chunk: int, deltas: bool) -> None:
    run = make(256, deltas=deltas, chunked_prefill_size=chunk)
    reqs = [request(f"r{i}", p, 12) for i, p in enumerate(prompts(1, 16))]
    for req in reqs:
        run.scheduler.add(req)
    drive(run, overlap)
    for req in reqs:
        assert run.outputs[req.rid] == reference_output(req.prompt, 12, STOP)
    assert_all_pages_back(run)


def test_shared_prefix_is_served_from_the_cache() -> None:
    run = make(256)
    prefix = list(range(100, 130))  # 30 tokens: 7 whole pages
    first = request("a", [*prefix, 1, 2], 4)
    run.scheduler.add(first)
    drive(run)
    second = request("b", [*prefix, 3, 4, 5], 4)
    run.scheduler.add(second)
    drive(run)
    assert second.cached_tokens >= (len(prefix) // PAGE) * PAGE
    assert run.outputs["b"] == reference_output(second.prompt, 4, STOP)
    assert_all_pages_back(run)


@pytest.mark.parametrize("deltas", [False, True], ids=["whole-lists", "page-deltas"])
def test_small_pool_retracts_and_still_completes_correctly(deltas: bool) -> None:
    # 24 pages = 96 tokens for 8 requests that each grow to ~45 tokens, admitted optimistically
    # (a small reservation ratio), so decode outgrows the pool.
    run = make(
        24,
        deltas=deltas,
        max_running_requests=8,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )
    reqs = [request(f"r{i}", p, 30) for i, p in enumerate(prompts(2, 8, 10, 20))]
    for req in reqs:
        run.scheduler.add(req)
    drive(run)
    assert sum(r.retractions for r in reqs) > 0, "the workload was meant to force retraction"
    for req in reqs:
        assert run.outputs[req.rid] == reference_output(req.prompt, 30, STOP)
    assert_all_pages_back(run)


def test_eviction_under_a_small_pool_keeps_outputs_correct() -> None:
    run = make(16)
    for i, prompt in enumerate(prompts(3, 12, 20, 40)):
        req = request(f"r{i}", prompt, 6)
        run.scheduler.add(req)
        drive(run)
        assert run.outputs[req.rid] == reference_output(prompt, 6, STOP)
    assert_all_pages_back(run)


def test_abort_frees_pages() -> None:
    run = make(64)
    reqs = [request(f"r{i}", p, 40) for i, p in enumerate(prompts(4, 6, 10, 30))]
    for req in reqs:
        run.scheduler.add(req)
    drive(run, aborts={3: "r1", 5: "r4", 9: "r0"})
    assert {"r0", "r1", "r4"}.isdisjoint(run.finishes)
    assert_all_pages_back(run)


def test_longest_prefix_first_admits_the_best_cached_request_first() -> None:
    run = make(256, max_running_requests=1, schedule_policy="lpm")
    prefix = list(range(100, 124))  # 6 whole pages
    run.scheduler.add(request("warm", [*prefix, 1], 2))
    drive(run)
    cold = [request(f"cold{i}", [500 + i, 501, 502, 503, 504], 2) for i in range(2)]
    hit = request("hit", [*prefix, 7, 8], 2)
    for req in [*cold, hit]:
        run.scheduler.add(req)
    plan = run.scheduler.schedule()  # one slot: for the request with the longest cached prefix
    assert plan is not None
    assert [r.rid for r in run.scheduler.running] == ["hit"]
    assert [r.rid for r in run.scheduler.waiting] == ["cold0", "cold1"]  # arrival order kept
    collect(run, plan)
    drive(run)
    for req in [*cold, hit]:
        assert run.outputs[req.rid] == reference_output(req.prompt, 2, STOP)
    assert_all_pages_back(run)


def test_first_come_first_served_keeps_arrival_order() -> None:
    run = make(256, max_running_requests=1)
    prefix = list(range(100, 124))
    run.scheduler.add(request("warm", [*prefix, 1], 2))
    drive(run)
    for req in [request("cold", [500, 501, 502], 2), request("hit", [*prefix, 7], 2)]:
        run.scheduler.add(req)
    run.scheduler.schedule()
    assert [r.rid for r in run.scheduler.running] == ["cold"]


def test_full_queue_is_refused() -> None:
    run = make(64, max_queued_requests=2)
    run.scheduler.add(request("a", [9], 1))
    run.scheduler.add(request("b", [9], 1))
    with pytest.raises(QueueFull):
        run.scheduler.add(request("c", [9], 1))


def test_request_larger_than_the_pool_is_refused() -> None:
    run = make(4)
    with pytest.raises(ValueError, match="raise --max-total-tokens"):
        run.scheduler.add(request("a", list(range(8, 20)), 10))


def test_unchunked_prompt_beyond_the_prefill_budget_is_refused() -> None:
    # Without chunking a prompt is prefilled in one forward, so its length is its activations.
    run = make(256, chunked_prefill_size=-1)
    with pytest.raises(ValueError, match="exceeds --max-prefill-tokens"):
        run.scheduler.add(request("a", list(range(8, 8 + 65)), 1))
    run.scheduler.add(request("b", list(range(8, 8 + 64)), 1))
    drive(run)
    assert run.finishes == {"b": "length"}
    assert_all_pages_back(run)


def test_chunked_prompt_beyond_the_prefill_budget_is_served_in_chunks() -> None:
    run = make(256, chunked_prefill_size=16)
    req = request("a", list(range(8, 8 + 100)), 3)
    run.scheduler.add(req)
    drive(run)
    assert run.outputs["a"] == reference_output(req.prompt, 3, STOP)
    assert_all_pages_back(run)


# A few shared prefixes, so prefix-cache hits (and evictions of shared pages) are common.
PREFIXES = [[], list(range(200, 212)), list(range(300, 317))]
prompt_strategy = st.builds(
    lambda prefix, suffix: PREFIXES[prefix] + suffix,
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(8, 999), min_size=1, max_size=20),
)
workload = st.lists(
    st.tuples(
        prompt_strategy,  # prompt
        st.integers(1, 20),  # max_new_tokens
        st.integers(0, 30),  # step at which to abort it (0: never)
        st.integers(0, 6),  # steps between this request and the previous one
    ),
    min_size=4,
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(
    jobs=workload,
    num_pages=st.integers(12, 64),
    chunk=st.sampled_from([-1, 3, 8]),
    overlap=st.booleans(),
    radix=st.booleans(),
    ratio=st.sampled_from([0.05, 0.7]),
    policy=st.sampled_from(["fcfs", "lpm"]),
    deltas=st.booleans(),
)
def test_random_workload_is_correct_and_leaks_nothing(
    jobs: list[tuple[list[int], int, int, int]],
    num_pages: int,
    chunk: int,
    overlap: bool,
    radix: bool,
    ratio: float,
    policy: str,
    deltas: bool,
) -> None:
    run = make(
        num_pages,
        radix=radix,
        deltas=deltas,
        chunked_prefill_size=chunk,
        init_new_token_ratio=ratio,
        min_new_token_ratio=min(ratio, 0.1),
        schedule_policy=policy,
    )
    aborts, arrivals, step = {}, [], 0
    for i, (prompt, max_new, abort_at, gap) in enumerate(jobs):
        step += gap
        if len(prompt) + max_new > num_pages * PAGE:
            continue
        arrivals.append((step, request(f"r{i}", prompt, max_new)))
        if abort_at:
            aborts.setdefault(step + abort_at, f"r{i}")
    started = list(arrivals)
    drive(run, overlap, aborts, arrivals)
    event(f"retractions: {min(sum(r.retractions for _, r in started), 3)}")
    event(f"cache hits: {sum(r.cached_tokens > 0 for _, r in started) > 0}")
    for rid, reason in run.finishes.items():
        req_prompt, req_max = next((job[0], job[1]) for i, job in enumerate(jobs) if f"r{i}" == rid)
        expected = reference_output(req_prompt, req_max, STOP)
        assert run.outputs[rid] == expected
        assert reason == ("stop" if expected[-1] in STOP else "length")
    assert_all_pages_back(run)


def test_a_finished_grammar_ends_its_request_with_stop_even_ignoring_eos() -> None:
    run = make(num_pages=16)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    run.scheduler.add(Req("g", [1, 2, 3], sampling, frozenset(), worker=0))
    plan = run.scheduler.schedule()
    assert plan is not None
    result = run.model.run(plan)
    result.grammar_ended = [True]
    out = run.scheduler.process(result)
    (finish,) = out.batches[0].finish
    assert finish is not None and finish.reason == "stop"
    assert finish.matched == result.tokens[0]
    assert not run.scheduler.has_work


def test_steps_that_decode_carry_at_most_the_mixed_budget_of_prompt_tokens() -> None:
    run = make(256, chunked_prefill_size=32)
    run.scheduler.mixed_budget = lambda decodes: 4 * decodes
    early = request("early", prompts(3, 1, 20, 20)[0], 30)
    run.scheduler.add(early)
    late = [request(f"late{i}", p, 6) for i, p in enumerate(prompts(4, 3, 30, 40))]
    arrivals = [(3, req) for req in late]
    plans: list[StepPlan] = []
    schedule = run.scheduler.schedule

    limits: list[tuple[int, int, int]] = []  # (budget, its batch, requests in the scheduler)

    def recording() -> StepPlan | None:
        held = len(run.scheduler.running) + len(run.scheduler.waiting)
        plan = schedule()
        if plan is not None:
            plans.append(plan)
            limits.append((run.scheduler.mixed_limit, run.scheduler.mixed_rows, held))
        return plan

    run.scheduler.schedule = recording  # type: ignore[method-assign]
    drive(run, arrivals=arrivals)
    for plan, (limit, rows, held) in zip(plans, limits, strict=True):
        decodes = sum(seq.input_ids is None for seq in plan.seqs)
        prompt_tokens = sum(seq.extend for seq in plan.seqs if seq.input_ids is not None)
        # Sized for the batch the step fills to: its decode rows and the requests still
        # prefilling or waiting (the cap of 8 is not reached here).
        assert rows == (max(decodes, held) if decodes else 0)
        assert prompt_tokens <= (4 * rows if decodes else 32)
        # What the step trace logs: the mixed budget the step was held to, 0 with no decodes.
        assert limit == 4 * rows
    assert any(
        rows > sum(s.input_ids is None for s in p.seqs) > 0
        for p, (_, rows, _) in zip(plans, limits, strict=True)
    )
    assert any(sum(s.input_ids is None for s in p.seqs) == 0 and len(p.seqs) == 1 for p in plans)
    for req in [early, *late]:
        assert run.outputs[req.rid] == reference_output(req.prompt, req.max_new, STOP)
    assert_all_pages_back(run)


def test_while_requests_wait_the_mixed_budget_is_sized_for_the_batch_at_its_cap() -> None:
    run = make(256, max_running_requests=4, chunked_prefill_size=64)
    asked: list[int] = []
    run.scheduler.mixed_budget = lambda rows: asked.append(rows) or 8
    first = request("first", prompts(5, 1, 8, 8)[0], 20)
    run.scheduler.add(first)
    collect(run, run.scheduler.schedule())  # its prefill: no decode rows, no mixed budget
    assert asked == []
    for i, prompt in enumerate(prompts(6, 6, 30, 30)):
        run.scheduler.add(request(f"w{i}", prompt, 4))
    run.scheduler.schedule()
    # One row decodes, six wait: the budget is the one for the 4 rows the batch fills to.
    assert asked == [4] and run.scheduler.mixed_rows == 4


def test_the_budget_counts_only_the_waiting_requests_the_kv_pool_could_take() -> None:
    """One request decoding (an 8-token prompt: 2 pages of 4 tokens, 14 tokens of its output
    share reserved) and three waiting 30-token prompts, each needing 32 tokens with its output
    share: a pool of 16 pages has room for one of them (56 - 14 = 42 tokens), so the budget is
    sized for 2 rows; 24 pages for two (3 rows); 256 for all (4)."""

    def rows_asked(num_pages: int) -> int:
        run = make(num_pages, max_running_requests=8, chunked_prefill_size=64)
        asked: list[int] = []
        run.scheduler.mixed_budget = lambda rows: asked.append(rows) or 8
        run.scheduler.add(request("first", prompts(5, 1, 8, 8)[0], 20))
        collect(run, run.scheduler.schedule())  # its prefill: no decode rows, no budget
        for i, prompt in enumerate(prompts(9, 3, 30, 30)):
            run.scheduler.add(request(f"w{i}", prompt, 4))
        run.scheduler.schedule()
        return asked[-1]

    assert [rows_asked(pages) for pages in (16, 24, 256)] == [2, 3, 4]


def test_a_queue_fills_the_decode_batch_where_a_budget_by_its_rows_alone_holds_it_low() -> None:
    """Closed-loop clients, 48-token prompts, 24 output tokens (23 decode steps), a budget of
    8 + rows / 2 tokens: sized by its rows alone a step admits (8 + rows / 2) / 48 requests
    while rows / 23 finish, so the batch settles near 5 rows of its 32; sized for the batch at
    its cap, 24 / 48 admissions a step hold 11.5."""

    def late_rows(by_rows_alone: bool) -> float:
        run = make(4096, max_running_requests=32, chunked_prefill_size=256, max_prefill_tokens=256)
        run.scheduler.mixed_budget = lambda rows: 8 + rows // 2
        if by_rows_alone:
            run.scheduler._batch_ahead = lambda decodes: decodes  # type: ignore[method-assign]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        made = 0

        def client() -> Req:
            nonlocal made
            made += 1
            prompt = [8 + (made * 31 + i) % 900 for i in range(48)]
            return Req(f"c{made}", prompt, sampling, STOP, worker=0)

        for _ in range(32):
            run.scheduler.add(client())
        rows: list[int] = []
        for _ in range(600):
            plan = run.scheduler.schedule()
            assert plan is not None
            rows.append(sum(seq.input_ids is None for seq in plan.seqs))
            before = len(run.finishes)
            collect(run, plan)
            for _ in range(len(run.finishes) - before):
                run.scheduler.add(client())  # a client sends its next request
        late = rows[300:]
        return sum(late) / len(late)

    alone, ahead = late_rows(True), late_rows(False)
    assert alone == pytest.approx(5, abs=1)
    assert ahead == pytest.approx(11.5, abs=1.5)
