"""The scheduler with the tiered prefix cache, against the model-free stand-in of
tests/unit/core/fake_model.py extended with a host KV tier. The executor is a FIFO of jobs —
step plans (their load-backs first) and backups — run in submission order, as late as the
scheduler allows: a result is taken only when processed, a copy only when waited on.

Random multi-turn sessions (each turn: the last prompt, its output and a few new tokens) over a
device pool too small to keep them must reproduce every request's solo output, which the fake
derives from the KV it reads back through the page table (a wrong or late load-back changes
it); afterwards every page of both tiers is back.
"""

from __future__ import annotations

from collections import deque

from hypothesis import event, given, settings
from hypothesis import strategies as st

from m3serve.core.hicache.prefix_cache import HiPrefixCache, WritePolicy
from m3serve.core.hicache.tickets import CopyTracker, Ticket
from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import SamplingParams, StepPlan, StepResult

from ..fake_model import FakeModel, reference_output

PAGE = 4
STOP = frozenset({7})


class TieredFake:
    """The fake model plus a host KV tier; jobs run in the order they were submitted."""

    def __init__(self, num_pages: int, host_pages: int, max_slots: int) -> None:
        self.model = FakeModel(num_pages, PAGE, max_slots, deltas=True)
        self.host: list[int | None] = [None] * (host_pages * PAGE)
        self.jobs: deque[StepPlan | Ticket] = deque()
        self.results: dict[int, StepResult] = {}
        self.tracker = CopyTracker(submit=self.jobs.append, before_wait=self.run_until)

    def run_one(self) -> None:
        job = self.jobs.popleft()
        if isinstance(job, Ticket):
            self.copy(self.model.kv, self.host, job.device, job.host)
            job.settle()
            return
        for load in job.loads:  # layer by layer in the real forward; all before it reads here
            self.copy(self.host, self.model.kv, load.host, load.device)
        self.results[job.step] = self.model.run(job)
        for load in job.loads:
            self.tracker.get(load.op).settle()

    def copy(self, src: list, dst: list, src_pages: list[int], dst_pages: list[int]) -> None:
        for s, d in zip(src_pages, dst_pages, strict=True):
            dst[d * PAGE : (d + 1) * PAGE] = src[s * PAGE : (s + 1) * PAGE]

    def run_until(self, ticket: Ticket) -> None:
        while not ticket.issued:
            self.run_one()

    def result(self, step: int) -> StepResult:
        while step not in self.results:
            self.run_one()
        return self.results.pop(step)


def sessions(seed: int, count: int, turns: int) -> list[list[list[int]]]:
    """Per session, each turn's prompt: the previous prompt + its output + 1-6 new tokens."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(8, 1000) for _ in range(rng.randint(8, 20))]
        turns_of = []
        for _ in range(turns):
            turns_of.append(prompt)
            reply = reference_output(prompt, 6, STOP)
            prompt = [*prompt, *reply, *(rng.randrange(8, 1000) for _ in range(rng.randint(1, 6)))]
        out.append(turns_of)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
    num_pages=st.integers(12, 28),
    ratio=st.sampled_from([2, 4]),
    overlap=st.booleans(),
    chunk=st.sampled_from([-1, 6]),
    count=st.integers(2, 5),
    gap=st.integers(0, 3),
)
def test_multi_turn_sessions_over_a_small_pool_are_correct_and_leak_nothing(
    seed: int,
    policy: WritePolicy,
    num_pages: int,
    ratio: int,
    overlap: bool,
    chunk: int,
    count: int,
    gap: int,
) -> None:
    args = SchedArgs(max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=chunk)
    fake = TieredFake(num_pages, ratio * num_pages, args.max_running_requests)
    cache = HiPrefixCache(num_pages, ratio * num_pages, PAGE, policy, fake.tracker)
    scheduler = Scheduler(args, num_pages, PAGE, True, cache=cache, page_deltas=True)
    arrivals: list[tuple[int, Req]] = []
    for s, turns in enumerate(sessions(seed, count, turns=4)):
        for t, prompt in enumerate(turns):
            if len(prompt) + 6 <= num_pages * PAGE:
                sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
                at = t * (8 + gap) + s * gap
                arrivals.append((at, Req(f"s{s}t{t}", prompt, sampling, STOP, worker=0)))
    arrivals.sort(key=lambda item: item[0])
    reqs = [req for _, req in arrivals]
    outputs: dict[str, list[int]] = {}
    pending: deque[StepPlan] = deque()
    for tick in range(10_000):
        while arrivals and arrivals[0][0] <= tick:
            scheduler.add(arrivals.pop(0)[1])
        plan = scheduler.schedule()
        if plan is not None:
            fake.jobs.append(plan)
            pending.append(plan)
        if pending and (len(pending) > 1 or not overlap or plan is None):
            out = scheduler.process(fake.result(pending.popleft().step))
            for batch in out.batches.values():
                for rid, ids in zip(batch.rids, batch.new_ids, strict=True):
                    outputs.setdefault(rid, []).extend(ids)
        scheduler.idle_check()
        if not arrivals and not pending and not scheduler.has_work:
            break
    else:
        raise AssertionError("the scheduler did not finish the workload")
    event(f"host hits: {scheduler.host_hit_tokens > 0}")
    for req in reqs:
        assert outputs[req.rid] == reference_output(req.prompt, 6, STOP), req.rid
    while fake.jobs:
        fake.run_one()
    scheduler.idle_check()
    cache.reset()
    assert cache.pool.num_free == cache.pool.num_pages
    assert cache.host_pool.num_free == cache.host_pool.num_pages


class Fetch:
    """An L3 fetch in progress, as `Req.fetch` sees it."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        raise AssertionError("admission never waits on a fetch")


def test_a_request_waiting_for_its_prefix_fetch_holds_up_no_other_request() -> None:
    scheduler = Scheduler(SchedArgs(max_running_requests=4), 32, PAGE, True)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
    fetching = Req("fetching", list(range(10, 30)), sampling, STOP, worker=0)
    fetching.fetch = fetch = Fetch()
    other = Req("other", list(range(40, 50)), sampling, STOP, worker=0)
    scheduler.add(fetching)
    scheduler.add(other)
    plan = scheduler.schedule()
    assert plan is not None and [r.rid for r in scheduler.running] == ["other"]
    assert list(scheduler.waiting) == [fetching]
    fetch.finished = True
    scheduler.schedule()
    assert [r.rid for r in scheduler.running] == ["other", "fetching"]
