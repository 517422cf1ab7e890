"""The scheduling policy, free of I/O: turn queued and running requests into the next
`StepPlan`, and fold a `StepResult` back into request state and per-worker `TokenBatch`es.

Every step decodes one token for each running request that finished its prefill, then fills
the remaining prefill budget with prompt chunks: first requests already prefilling, then new
admissions, in arrival order or (`--schedule-policy lpm`) longest cached prefix first.
Admission needs a slot, a prefix-cache lookup, pages for the chunk and a reservation for future
decode tokens (a decaying share of each request's max_new_tokens). When decode runs out of
pages, the newest requests are retracted: their KV is cached in the radix tree and they wait to
be recomputed.

`schedule` may run before the previous step's result is processed (overlap): a plan never
depends on tokens the CPU has not seen — decode inputs come from the engine core's slot table.
Speculative verify rows too: a row planned while an earlier verify step of its request is in
flight starts where the executor says (core/spec/lengths.py), and its pages cover the worst case,
every draft in flight accepted (`Req.spec_unseen`); processing gives back the surplus.

HiCache's storage tier (`storage`, core/hicache/storage_tier.py), when the host-cache actor
runs: a queued request may start an L3 fetch of its prefix (admission passes over it until that
is settled), and each `schedule` first lets the tier run a round, failing the requests it says
can no longer be served (their fetch died with the actor).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from m3serve.core.kvcache.pages import PagePool
from m3serve.core.kvcache.radix import PrefixCache
from m3serve.core.kvcache.slots import SlotPool
from m3serve.core.prefill_demand import PrefillDemand
from m3serve.core.req import Phase, Req
from m3serve.core.spec.settings import spec_eligible
from m3serve.core.step_commit import Outputs, StepCommit
from m3serve.runtime.config import SchedArgs
from m3serve.runtime.messages import Finish, SeqStep, StepPlan

if TYPE_CHECKING:
    from m3serve.core.hicache.storage_tier import StorageTier

log = logging.getLogger(__name__)

# `Outputs` is imported from here by the engine core and the scheduler actor.
__all__ = ["LPM_MAX_WAITING", "Outputs", "QueueFull", "Scheduler"]

# Past this many waiting requests, longest-prefix-first costs more than it saves and the queue
# is taken in arrival order (SGLang's cut-off).
LPM_MAX_WAITING = 128


class QueueFull(RuntimeError):
    """The waiting queue is at --max-queued-requests (HTTP 503)."""


class Scheduler(StepCommit):
    """Requests in, step plans out; folding the results back is `StepCommit`'s."""

    def __init__(
        self,
        args: SchedArgs,
        num_pages: int,
        page_size: int,
        radix: bool,
        mixed_budget: Callable[[int], int] | None = None,
        cache: PrefixCache | None = None,
        storage: StorageTier | None = None,
        page_deltas: bool = False,
        demand: PrefillDemand | None = None,
    ) -> None:
        """`mixed_budget(decodes)`: the prompt tokens a step with that many decode rows may
        carry (core/step_cost.py); None lets every step fill the whole prefill budget.
        `cache`: the prefix cache over `num_pages` device pages, when it is not the plain one
        (HiCache's tiered cache); `storage`: HiCache's L3 tier over it. `page_deltas`: rows
        carry only the page-list changes since their slot's last step (an engine core that
        keeps slot page lists, `SlotPages`); else every row its whole list. `demand`: told of
        every request that finishes (the mixed budget's cap, core/prefill_demand.py)."""
        self.args = args
        self.demand = demand
        self.mixed_budget = mixed_budget
        # The prompt tokens the last planned step was allowed beside its decode rows by
        # `mixed_budget` (0: not limited by it); the step trace logs it with mixed steps.
        self.mixed_limit = 0
        self.mixed_rows = 0  # the decode batch that budget was sized for (`_batch_ahead`)
        self.page_deltas = page_deltas
        self.page_size = page_size
        self.cache = cache or PrefixCache(PagePool(num_pages), page_size, enabled=radix)
        self.storage = storage
        self.pool = self.cache.pool
        self.slots = SlotPool(args.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.step = 0
        self.inflight: dict[int, list[Req | None]] = {}  # step -> request per sampled row
        self.inflight_drafts: dict[int, list[int]] = {}  # step -> drafts per sampled row
        self.new_token_ratio = args.init_new_token_ratio
        self.pending_errors = Outputs()
        self.retracted = 0  # requests retracted so far (a metric)
        # Prompt tokens at first admission, and those of them found cached (metrics).
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # on the device
        self.host_hit_tokens = 0  # loaded back from host memory (HiCache)
        # Speculative decoding (set by the engine core): draft tokens per verify row, 0 = off;
        # and how many verify rows committed each number of tokens so far (a metric).
        self.spec_draft = 0
        self.spec_accept_counts: dict[int, int] = {}

    # ------------------------------------------------------------------ requests in

    def add(self, req: Req, fit_to_pool: bool = False) -> None:
        """Queue a request. With fit_to_pool (no explicit max_new_tokens) its output budget is
        lowered to what the KV pool can hold rather than refused."""
        self.check(req, fit_to_pool)
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        if self.storage is not None:
            self.storage.fetch_prefix(req)

    def check(self, req: Req, fit_to_pool: bool = False) -> None:
        """Refuse a request the queue or the KV pool cannot take (what `add` checks first)."""
        if len(self.waiting) >= self.args.max_queued_requests:
            raise QueueFull(f"the waiting queue is full ({self.args.max_queued_requests})")
        # A verify step writes a block past the last token the request may keep, and with
        # overlap it is planned while the previous block may still be kept whole.
        capacity = self.pool.num_pages * self.page_size - 2 * self.spec_draft
        if fit_to_pool:
            req.max_new = min(req.max_new, capacity - len(req.prompt))
        needed = len(req.prompt) + max(req.max_new, 1)
        if needed > capacity:
            raise ValueError(
                f"prompt + max_new_tokens need {needed} KV tokens; the pool holds "
                f"{self.pool.num_pages * self.page_size} (raise --max-total-tokens)"
            )
        if self.args.chunked_prefill_size == -1 and len(req.prompt) > self.args.max_prefill_tokens:
            # Unchunked, a prompt is one forward: its activations grow with its length.
            raise ValueError(
                f"the prompt ({len(req.prompt)} tokens) exceeds --max-prefill-tokens "
                f"({self.args.max_prefill_tokens}), the most one forward takes with chunked "
                "prefill off"
            )

    def abort(self, rid: str) -> None:
        req = self.by_rid.get(rid)
        if req is None:
            return
        req.finish = Finish("abort")
        self._finish(req)

    @property
    def has_work(self) -> bool:
        """Requests to run, or L3 writes still to send (the engine polls while there are)."""
        storage = self.storage is not None and self.storage.has_work
        return bool(self.waiting or self.running) or storage

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        if self.storage is not None:
            for req, message in self.storage.poll():
                self._fail(req, message, 500)
        decode = self._plan_decode()
        prefill = self._plan_prefill(len(decode))
        # Load-backs of admitted requests always go out with this step, even one with nothing
        # else to run: a later eviction may wait for them.
        if not decode and not prefill and not self.cache.has_unsent_loads:
            return None
        self.step += 1
        plan = StepPlan(step=self.step, seqs=[], loads=self.cache.take_loads())
        rows: list[Req | None] = []
        for req in decode:
            plan.seqs.append(self._decode_seq(req))
            rows.append(req)
        for req, chunk in prefill:
            seq = self._prefill_seq(req, chunk, plan)
            plan.seqs.append(seq)
            if seq.sample:
                rows.append(req)
        self.inflight[self.step] = rows
        if self.spec_draft:
            self.inflight_drafts[self.step] = [seq.draft for seq in plan.seqs if seq.sample]
        self.new_token_ratio = max(
            self.new_token_ratio - self.args.new_token_ratio_decay, self.args.min_new_token_ratio
        )
        return plan

    def _plan_decode(self) -> list[Req]:
        # A request whose in-flight step brings it to max_new_tokens is done: no extra step.
        decode = [r for r in self.running if r.prefilled and len(r.output) + r.inflight < r.max_new]
        # Newest first out: retract from the back until every decode token has a page.
        while decode:
            ps = self.page_size
            short = [(r, -(-self._decode_end(r) // ps) - len(r.pages)) for r in decode]
            short = [(r, n) for r, n in short if n > 0]
            if not short:
                return decode
            pages = self.cache.alloc(sum(n for _, n in short))
            if pages is not None:
                for req, n in short:
                    req.pages.extend(pages[:n])
                    pages = pages[n:]
                return decode
            victim = decode.pop()
            self._retract(victim)
        return decode

    def _drafts(self, req: Req) -> int:
        """Draft tokens its next decode verifies (speculative decoding): none past its
        max_new_tokens, and none for requests whose sampling a verify step cannot honour."""
        if not self.spec_draft or req.remaining_new - req.inflight <= 1 or not spec_eligible(req):
            return 0
        # A whole block even near the end: the scheduler cuts what passes max_new_tokens.
        return self.spec_draft

    def _decode_end(self, req: Req) -> int:
        """The KV position past the last one its next decode may write: its block, after every
        draft of its verify steps in flight (their verdict may not be in yet)."""
        return req.kv_len + req.spec_unseen + 1 + self._drafts(req)

    def _plan_prefill(self, decodes: int) -> list[tuple[Req, int]]:
        budget = self.args.max_prefill_tokens
        self.mixed_limit = self.mixed_rows = 0
        if self.args.chunked_prefill_size > 0:
            budget = min(budget, self.args.chunked_prefill_size)
            if decodes and self.mixed_budget is not None:
                self.mixed_rows = self._batch_ahead(decodes)
                self.mixed_limit = self.mixed_budget(self.mixed_rows)
                budget = min(budget, self.mixed_limit)
        chosen: list[tuple[Req, int]] = []
        if self.args.schedule_policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_WAITING:
            self._longest_prefix_first()
        for req in self.running:
            if not req.prefilled and budget > 0:
                chunk = self._chunk(req, budget, first=not chosen)
                if chunk and self._grow(req, chunk):
                    chosen.append((req, chunk))
                    budget -= chunk
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.args.max_running_requests:
                break
            if not req.ready:
                continue  # its prefix is still being fetched (HiCache L3): the next one goes
            if req.inflight:
                break  # its last token is still on the way back; recompute after it lands
            if not self._admit(req):
                break
            self.waiting.remove(req)
            chunk = self._chunk(req, budget, first=not chosen)
            if not chunk or not self._grow(req, chunk):
                break  # admitted; the chunk waits for the next step's budget
            chosen.append((req, chunk))
            budget -= chunk
        return chosen

    def _batch_ahead(self, decodes: int) -> int:
        """The decode batch a mixed step's prompt budget is sized for: while requests wait for
        a slot, the one admitting them fills to (up to --max-running-requests), else the rows
        decoding now. Sized by the rows alone, a batch below its cap admits prompts only as
        fast as its rows finish, and stays there: H100s serving 256 streams of 1K-token
        prompts and 256 outputs held 70-90 decode rows, as many as that budget admits, and gave
        up to 23 % fewer output tokens/s than 128 streams; sized for the batch it fills to,
        ~165 rows and 45 % more (18.9K tok/s against 13.0K, the same machine).

        Only the waiting requests the KV pool could take count (in queue order, each needing
        its prompt and its share of output, as `_admit` reserves, cached prefixes aside): with
        long prompts a full pool admits none, and a budget sized for them would only lengthen
        the steps of the batch as it is."""
        room = self.args.max_running_requests - len(self.running)
        if not self.waiting or room <= 0:
            return max(decodes, len(self.running))
        free = self.cache.available_pages * self.page_size - self._reserved_tokens()
        admissible = 0
        for req in itertools.islice(self.waiting, room):
            free -= len(req.key_tokens) + self._output_share(req)
            if free < 0:
                break
            admissible += 1
        return max(decodes, len(self.running) + admissible)

    def _longest_prefix_first(self) -> None:
        """Reorder the waiting queue by cached prefix, longest first (ties keep arrival order)."""
        cached = {id(req): self.cache.cached_length(req.key_tokens) for req in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda req: -cached[id(req)]))

    def _chunk(self, req: Req, budget: int, first: bool) -> int:
        remaining = req.prefill_target - req.kv_len
        if self.args.chunked_prefill_size > 0:
            return min(remaining, budget)
        # Without chunking a prompt goes whole; the first one of a step may exceed the budget.
        return remaining if remaining <= budget or first else 0

    def _admit(self, req: Req) -> bool:
        """Give a waiting request a slot and its cached prefix, if memory allows."""
        tokens = req.key_tokens
        match = self.cache.acquire(tokens)
        reserve = self._reserved_tokens() + self._output_share(req)
        need_pages = -(-(len(tokens) - match.num_tokens + reserve) // self.page_size)
        slot = self.slots.alloc() if need_pages <= self.cache.available_pages else None
        # HiCache: the match's host-only part gets device pages now, its copy goes with the step.
        loaded = self.cache.load_back(match) if slot is not None else None
        if loaded is None:
            if slot is not None:
                self.slots.free(slot)
            self.cache.release(tokens[: match.num_tokens], match.pages, match)
            return False
        req.slot, req.match, req.pages = slot, loaded, list(loaded.pages)
        req.pages_synced = 0
        req.kv_len = loaded.num_tokens
        req.phase, req.prefilled = Phase.RUNNING, False
        if not req.admitted_once:
            # Reloaded tokens count as cached: they are not computed again.
            req.cached_tokens, req.admitted_once = loaded.num_tokens, True
            self.prompt_tokens += len(req.prompt)
            self.cached_prompt_tokens += match.num_tokens
            self.host_hit_tokens += loaded.num_tokens - match.num_tokens
        self.running.append(req)
        return True

    def _reserved_tokens(self) -> int:
        """KV the running requests will still claim: the rest of their prompt, plus a decaying
        share of their remaining output budget."""
        return sum(
            (0 if r.prefilled else r.prefill_target - r.kv_len) + self._output_share(r)
            for r in self.running
        )

    def _output_share(self, req: Req) -> int:
        """The KV a request's remaining output is reserved at (a decaying share of it)."""
        return int(req.remaining_new * self.new_token_ratio)

    def _grow(self, req: Req, extend: int) -> bool:
        """Pages for KV positions up to kv_len + extend."""
        needed = -(-(req.kv_len + extend) // self.page_size) - len(req.pages)
        if needed <= 0:
            return True
        pages = self.cache.alloc(needed)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _decode_seq(self, req: Req) -> SeqStep:
        # A verify row's anchor is committed now; its accepted drafts when the step is processed.
        # With a verify step of it in flight, `start` is a lower bound the executor corrects.
        pages, page_start = self._page_update(req)
        seq = SeqStep(
            None, req.kv_len, pages, slot=req.slot, draft=self._drafts(req), page_start=page_start
        )
        req.kv_len += 1
        req.inflight += 1
        req.spec_unseen += seq.draft
        return seq

    def _prefill_seq(self, req: Req, chunk: int, plan: StepPlan) -> SeqStep:
        start = req.kv_len
        last = start + chunk == req.prefill_target
        new = start == req.match.num_tokens if req.match else start == 0
        pages, page_start = self._page_update(req)
        seq = SeqStep(
            req.tokens[start : start + chunk],
            start,
            pages,
            slot=req.slot,
            sample=last,
            new_request=new,
            page_start=page_start,
        )
        if new:
            plan.sampling[req.slot] = req.sampling
            plan.prompt_ids[req.slot] = req.prompt
            plan.stop_ids[req.slot] = sorted(req.stop_ids)
            if req.output:
                plan.output_ids[req.slot] = list(req.output)
        req.kv_len += chunk
        if last:
            req.prefilled = True
            req.inflight += 1
        return seq

    def _page_update(self, req: Req) -> tuple[list[int], int]:
        """The pages a row of `req` carries, and the index they start at in its list."""
        if not self.page_deltas:
            return list(req.pages), 0
        start = req.pages_synced
        req.pages_synced = len(req.pages)
        return req.pages[start:], start

    def _retract(self, req: Req) -> None:
        """Give a running request's KV back (cached in the tree) and queue it for recompute."""
        log.info("retracting %s after %d tokens (KV pool exhausted)", req.rid, len(req.output))
        self._release(req)
        req.phase, req.prefilled, req.kv_len = Phase.WAITING, False, 0
        req.retractions += 1
        self.retracted += 1
        self.waiting.appendleft(req)
        # Decode is outgrowing memory: reserve more for future tokens again.
        self.new_token_ratio = self.args.init_new_token_ratio

    # ------------------------------------------------------------------ checks

    def idle_check(self) -> None:
        """With nothing running, every page is free or cached and every slot is free."""
        self.cache.check()
        assert self.cache.request_pages == sum(
            len(r.pages) - len(r.match.pages) for r in self.running if r.match is not None
        ), "pages held by requests do not add up"
        if not self.running:
            assert self.slots.num_free == self.slots.num_slots, "a slot leaked"
