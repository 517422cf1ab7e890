"""The scheduler's side of speculative decoding, against a model-free stand-in that verifies
drafts by reading its "KV" (token ids) back through the page table: verify rows get pages for
their whole block, commit what the stand-in accepts, cut at a stop token or max_new_tokens, and
give back the pages past the kept length. Outputs equal each request's solo greedy output, with
chunked prefill, prefix hits, retraction and aborts, and every page comes back."""

from __future__ import annotations

import hashlib
import random

import pytest

from m3serve.core.req import Req
from m3serve.core.scheduler import Scheduler
from m3serve.core.spec.lengths import SlotLengths
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import (
    SKIPPED_TOKEN,
    SamplingParams,
    SeqStep,
    StepPlan,
    StepResult,
)

from ..fake_model import VOCAB, FakeModel, next_token, reference_output

PAGE = 4
DRAFTS = 7
STOP = frozenset({7})


class VerifyingModel(FakeModel):
    """FakeModel plus verify rows: the draft is the true greedy chain, wrong from a position
    that depends on the step (so every acceptance length occurs); all of the block is written,
    then the target's token at each position is the hash of what the page table reads back.

    Like the executor thread it starts decode and verify rows at the slot's committed length
    (`SlotLengths`: the planned start lags under overlap) and drops the rows of slots whose last
    committed tokens held a stop token (SKIPPED_TOKEN), so their KV is never written."""

    def __init__(self, num_pages: int, page_size: int, max_slots: int, deltas: bool) -> None:
        super().__init__(num_pages, page_size, max_slots, deltas)
        self.accepts: list[int] = []
        self.lengths = SlotLengths(max_slots)
        self.stops: dict[int, frozenset[int]] = {}
        self.ended: set[int] = set()

    def run(self, plan: StepPlan) -> StepResult:
        for seq in plan.seqs:
            if seq.new_request:
                self.stops[seq.slot] = frozenset(plan.stop_ids.get(seq.slot, ()))
                self.ended.discard(seq.slot)
        live = [s for s in plan.seqs if s.input_ids is not None or s.slot not in self.ended]
        seqs = self.lengths.resolve(self.whole_pages(live))
        for seq in seqs:  # the resolved block lies inside the pages planned for the worst case
            assert len(seq.pages) * self.page_size >= seq.start + seq.extend
        plain = StepPlan(step=plan.step, seqs=[s for s in seqs if not s.draft])
        by_slot = dict(zip(*_unpack(super().run(plain)), strict=True))
        for seq in seqs:
            if seq.draft:
                by_slot[seq.slot] = self._verify(seq, plan.step)
            committed = len(by_slot[seq.slot]) if seq.draft else seq.extend
            self.lengths.advance(seq, committed)
            if seq.sample:
                stopped = any(t in self.stops.get(seq.slot, ()) for t in by_slot[seq.slot])
                (self.ended.add if stopped else self.ended.discard)(seq.slot)
        slots, tokens, blocks = [], [], []
        drafts = {seq.slot for seq in seqs if seq.draft}
        for seq in plan.seqs:
            if seq.sample:
                slots.append(seq.slot)
                block = by_slot.get(seq.slot)
                tokens.append(block[-1] if block else SKIPPED_TOKEN)
                blocks.append(block if seq.slot in drafts and block else [])
        return StepResult(step=plan.step, slots=slots, tokens=tokens, spec_tokens=blocks)

    def _verify(self, seq: SeqStep, step: int) -> list[int]:
        anchor = self.last_tokens[seq.slot]
        self.kv[self._slot(seq.pages, seq.start)] = anchor
        history = self._read(seq, seq.start + 1)
        chain = []
        for _ in range(seq.draft):
            chain.append(next_token(history + chain))
        wrong_from = _hash(step, seq.slot) % (seq.draft + 1)
        drafts = chain[:wrong_from] + [(t + 1) % VOCAB for t in chain[wrong_from:]]
        for offset, token in enumerate(drafts, start=1):
            self.kv[self._slot(seq.pages, seq.start + offset)] = token
        block = []
        for j in range(seq.draft + 1):
            target = next_token(self._read(seq, seq.start + j + 1))
            block.append(target)
            if j == seq.draft or drafts[j] != target:
                break
        self.last_tokens[seq.slot] = block[-1]
        self.accepts.append(len(block))
        return block

    def _read(self, seq: SeqStep, end: int) -> list[int]:
        history = [self.kv[self._slot(seq.pages, p)] for p in range(end)]
        assert None not in history, "read a KV slot nobody wrote"
        return history  # type: ignore[return-value]


def _unpack(result: StepResult) -> tuple[list[int], list[list[int]]]:
    return result.slots, [[t] for t in result.tokens]


def _hash(*values: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=4).digest(), "little")


def _scheduler(
    num_pages: int, deltas: bool = True, **sched: float | str
) -> tuple[Scheduler, VerifyingModel]:
    """Rows carry page deltas, as the engine core's scheduler sends them (the pages verify
    steps give back are sent again from there), unless `deltas` is False."""
    args = SchedArgs(**{"max_running_requests": 8, "max_prefill_tokens": 64, **sched})
    scheduler = Scheduler(args, num_pages, PAGE, radix=True, page_deltas=deltas)
    scheduler.spec_draft = DRAFTS
    return scheduler, VerifyingModel(num_pages, PAGE, args.max_running_requests, deltas)


def _request(rid: str, prompt: list[int], max_new: int) -> Req:
    return Req(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=max_new), STOP, 0)


def _prompts(seed: int, count: int, low: int = 1, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _drive(
    scheduler: Scheduler,
    model: VerifyingModel,
    aborts: dict[int, str] | None = None,
    overlap: bool = False,
    aborts_mid: dict[int, str] | None = None,
) -> dict[str, list[int]]:
    """Run the workload; with `overlap`, as the engine core's overlap loop: step N+1 is planned
    and run (the executor runs steps in order) before step N's result is processed. `aborts`
    land before a tick plans, `aborts_mid` after it launched and before it processes (with
    overlap, while two steps of the request are unprocessed)."""
    outputs: dict[str, list[int]] = {}
    in_flight: StepResult | None = None
    for tick in range(10_000):
        if aborts and tick in aborts:
            scheduler.abort(aborts[tick])
        plan = scheduler.schedule()
        launched = None
        if plan is not None:
            for seq in plan.seqs:
                if seq.draft:  # the block's pages are there before the step runs
                    assert seq.num_pages * PAGE >= seq.start + 1 + seq.draft
            launched = model.run(plan)
        previous = launched
        if overlap:
            previous, in_flight = in_flight, launched
        if aborts_mid and tick in aborts_mid:
            scheduler.abort(aborts_mid[tick])
        if previous is not None:
            out = scheduler.process(previous)
            for batch in out.batches.values():
                for rid, ids in zip(batch.rids, batch.new_ids, strict=True):
                    outputs.setdefault(rid, []).extend(ids)
        scheduler.idle_check()
        if not scheduler.has_work and in_flight is None:
            return outputs
    raise AssertionError("the scheduler did not finish the workload")


def _all_pages_back(scheduler: Scheduler) -> None:
    scheduler.idle_check()
    assert not scheduler.running and not scheduler.waiting
    scheduler.cache.reset()
    assert scheduler.pool.num_free == scheduler.pool.num_pages


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])


@OVERLAP
@pytest.mark.parametrize("chunk", [-1, 5], ids=["whole-prefill", "chunk-5"])
def test_verify_rows_reproduce_solo_outputs(chunk: int, overlap: bool) -> None:
    scheduler, model = _scheduler(256, chunked_prefill_size=chunk)
    reqs = [_request(f"r{i}", p, 20) for i, p in enumerate(_prompts(1, 12))]
    for req in reqs:
        scheduler.add(req)
    outputs = _drive(scheduler, model, overlap=overlap)
    for req in reqs:
        assert outputs[req.rid] == reference_output(req.prompt, 20, STOP)
    assert set(model.accepts) == set(range(1, DRAFTS + 2)), "not every acceptance length ran"
    _all_pages_back(scheduler)


@OVERLAP
def test_a_stop_token_inside_a_block_ends_the_request_there(overlap: bool) -> None:
    scheduler, model = _scheduler(256)
    prompt = next(
        p for p in _prompts(5, 2000, 3, 10) if 7 in reference_output(p, 40, frozenset())[2:30]
    )
    req = _request("s", prompt, 40)
    scheduler.add(req)
    outputs = _drive(scheduler, model, overlap=overlap)
    assert outputs["s"] == reference_output(prompt, 40, STOP)
    assert outputs["s"][-1] == 7
    _all_pages_back(scheduler)


@OVERLAP
def test_verify_rows_under_retraction_prefix_hits_and_aborts(overlap: bool) -> None:
    scheduler, model = _scheduler(
        28, max_running_requests=6, init_new_token_ratio=0.05, min_new_token_ratio=0.05
    )
    prefix = list(range(100, 116))
    reqs = [_request(f"r{i}", prefix + p, 24) for i, p in enumerate(_prompts(2, 6, 2, 10))]
    for req in reqs:
        scheduler.add(req)
    outputs = _drive(scheduler, model, {6: "r1"}, overlap, aborts_mid={9: "r3"})
    assert scheduler.retracted > 0, "the workload was meant to force retraction"
    assert sum(req.cached_tokens for req in reqs) > 0
    for req in reqs:
        want = reference_output(req.prompt, 24, STOP)
        got = outputs.get(req.rid, [])
        assert got == want if req.rid not in ("r1", "r3") else got == want[: len(got)]
    assert 0 < len(outputs["r3"]) < 24, "r3 was meant to be aborted while it decoded"
    _all_pages_back(scheduler)


@pytest.mark.parametrize("drafts", [0, DRAFTS], ids=["plain", "spec"])
def test_a_prefix_hit_after_an_overlapped_stop_reads_no_unwritten_kv(drafts: int) -> None:
    # The stop token ends a page: the executor drops the row that would write its KV, so the
    # page must not be cached with it; the next turn (prompt + output + more) hits the prefix.
    def stops_at_page_end(prompt: list[int]) -> bool:
        out = reference_output(prompt, 30, STOP)
        return out[-1] in STOP and len(out) > 2 and (len(prompt) + len(out)) % PAGE == 0

    prompt = next(p for p in _prompts(9, 5000, 5, 12) if stops_at_page_end(p))
    scheduler, model = _scheduler(256)
    scheduler.spec_draft = drafts
    scheduler.add(_request("a", prompt, 30))
    first = _drive(scheduler, model, overlap=True)
    follow = prompt + first["a"] + [300, 301]
    scheduler.add(_request("b", follow, 12))
    second = _drive(scheduler, model, overlap=True)
    assert second["b"] == reference_output(follow, 12, STOP)
    _all_pages_back(scheduler)


def _live_pages(req: Req) -> int:
    """The pages a running request needs: its KV and every block of its verify steps in flight
    accepted whole."""
    return -(-(req.kv_len + req.spec_unseen) // PAGE)


@OVERLAP
def test_the_pages_past_the_kept_length_go_back_after_each_verify_step(overlap: bool) -> None:
    scheduler, model = _scheduler(64)
    scheduler.add(_request("a", list(range(10, 15)), 200))
    in_flight = None
    for _ in range(8):
        plan = scheduler.schedule()
        assert plan is not None
        result = model.run(plan)
        if overlap:
            result, in_flight = in_flight, result
        if result is None:
            continue
        scheduler.process(result)
        (req,) = scheduler.running
        assert len(req.pages) == _live_pages(req), "pages past the kept KV were kept"
        # Every token's KV but the next anchor's, and with overlap one more anchor in flight.
        assert req.kv_len == len(req.tokens) - 1 + (1 if overlap else 0)
        assert req.spec_unseen == (DRAFTS if overlap else 0)
