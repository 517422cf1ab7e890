"""The tiered prefix cache under speculative decoding: verify rows (tests/unit/core/spec/
test_scheduler_verify.py's stand-in, which reads its "KV" back through the page table) over a
device pool too small for random multi-turn sessions, with the host tier of
test_scheduler_hicache.py. The verify rows' block pages, the pages past each kept length that go
back, and the backups and load-backs of evicted prefixes must leave every request's solo output
and, afterwards, every page of both tiers (the draft KV shares the device page ids, so one count
covers all three device pools)."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from m3serve.core.hicache.prefix_cache import HiPrefixCache, WritePolicy
from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import SamplingParams

from ..fake_model import reference_output
from ..spec.test_scheduler_verify import DRAFTS, VerifyingModel
from .test_scheduler_hicache import PAGE, STOP, TieredFake, sessions

MAX_NEW = 10


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
    num_pages=st.integers(14, 28),
    ratio=st.sampled_from([2, 4]),
    chunk=st.sampled_from([-1, 6]),
    count=st.integers(2, 4),
)
def test_verify_rows_over_a_tiered_cache_are_correct_and_leak_nothing(
    seed: int, policy: WritePolicy, num_pages: int, ratio: int, chunk: int, count: int
) -> None:
    args = SchedArgs(max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=chunk)
    fake = TieredFake(num_pages, ratio * num_pages, args.max_running_requests)
    model = fake.model = VerifyingModel(num_pages, PAGE, args.max_running_requests, deltas=True)
    cache = HiPrefixCache(num_pages, ratio * num_pages, PAGE, policy, fake.tracker)
    scheduler = Scheduler(args, num_pages, PAGE, True, cache=cache, page_deltas=True)
    scheduler.spec_draft = DRAFTS
    reqs = []
    for s, turns in enumerate(sessions(seed, count, turns=3)):
        for t, prompt in enumerate(turns):
            # What Scheduler.check admits: room for two blocks of drafts (one in flight).
            if len(prompt) + MAX_NEW + 2 * DRAFTS <= num_pages * PAGE:
                sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
                reqs.append(Req(f"s{s}t{t}", prompt, sampling, STOP, worker=0))
    # Turn by turn, so that later turns find earlier ones' prefixes on device, host or gone.
    reqs.sort(key=lambda req: int(req.rid.split("t")[1]))
    outputs: dict[str, list[int]] = {}
    for req in reqs:
        scheduler.add(req)
    for _ in range(10_000):
        plan = scheduler.schedule()
        if plan is not None:
            fake.jobs.append(plan)
            # Speculative steps run without overlap: each is processed before the next plan.
            out = scheduler.process(fake.result(plan.step))
            for batch in out.batches.values():
                for rid, ids in zip(batch.rids, batch.new_ids, strict=True):
                    outputs.setdefault(rid, []).extend(ids)
        scheduler.idle_check()
        if not scheduler.has_work:
            break
    else:
        raise AssertionError("the scheduler did not finish the workload")
    event(f"host hits: {scheduler.host_hit_tokens > 0}")
    event(f"blocks accepted: {max(model.accepts, default=0) > 1}")
    for req in reqs:
        assert outputs[req.rid] == reference_output(req.prompt, MAX_NEW, STOP), req.rid
    while fake.jobs:
        fake.run_one()
    scheduler.idle_check()
    cache.reset()
    assert cache.pool.num_free == cache.pool.num_pages
    assert cache.host_pool.num_free == cache.host_pool.num_pages
