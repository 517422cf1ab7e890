"""Folding a step's results back into the scheduler's requests: sampled tokens become output,
verify blocks commit their accepted drafts, finished requests give their slot and KV back (to
the prefix cache), and what each step produces is gathered per tokenizer worker (`Outputs`).

`Scheduler` (core/scheduler.py) plans the steps; this is its other half.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from m3serve.core.kvcache.radix import PrefixCache
from m3serve.core.kvcache.slots import SlotPool
from m3serve.core.prefill_demand import PrefillDemand
from m3serve.core.req import Phase, Req
from m3serve.runtime.messages import (
    SKIPPED_TOKEN,
    Error,
    Finish,
    StepResult,
    TokenBatch,
    TokenLogprob,
)


@dataclass
class Outputs:
    """What one processed step produces, per tokenizer worker."""

    batches: dict[int, TokenBatch] = field(default_factory=dict)
    errors: dict[int, list[Error]] = field(default_factory=dict)

    def add(
        self, req: Req, new_ids: list[int], logprob: TokenLogprob | None, accepted: int = 0
    ) -> None:
        """`accepted`: the tokens a speculative verify step committed for the row (0: none)."""
        batch = self.batches.get(req.worker)
        if batch is None:
            batch = TokenBatch(rids=[], new_ids=[], finish=[], cached_tokens=[])
            self.batches[req.worker] = batch
        batch.spec_accepted.append(accepted)
        batch.rids.append(req.rid)
        batch.new_ids.append(new_ids)
        batch.finish.append(req.finish)
        batch.cached_tokens.append(req.cached_tokens)
        if logprob is not None:
            if batch.logprobs is None:
                batch.logprobs = [[] for _ in batch.rids[:-1]]
            batch.logprobs.append([logprob])
        elif batch.logprobs is not None:
            batch.logprobs.append([])

    def fail(self, req: Req, message: str, code: int) -> None:
        self.errors.setdefault(req.worker, []).append(Error(req.rid, message, code))


class StepCommit:
    """The result side of `Scheduler`: `process`, `fail_step`, `take_errors` and the request
    endings they share with planning (`_finish`, `_release`)."""

    # The state this shares with the planning side; `Scheduler.__init__` sets it.
    page_size: int
    cache: PrefixCache
    slots: SlotPool
    waiting: deque[Req]
    running: list[Req]
    by_rid: dict[str, Req]
    inflight: dict[int, list[Req | None]]
    inflight_drafts: dict[int, list[int]]
    pending_errors: Outputs
    spec_accept_counts: dict[int, int]
    demand: PrefillDemand | None  # what finished requests needed prefilled per output token

    def process(self, result: StepResult) -> Outputs:
        out, self.pending_errors = self.pending_errors, Outputs()
        rows = self.inflight.pop(result.step, [])
        drafts = self.inflight_drafts.pop(result.step, None) or [0] * len(rows)
        logprobs = result.logprobs or [None] * len(result.tokens)
        ended = result.grammar_ended or [False] * len(result.tokens)
        spec = result.spec_tokens or [[] for _ in result.tokens]
        for req, token, logprob, done, block, draft in zip(
            rows, result.tokens, logprobs, ended, spec, drafts, strict=True
        ):
            if req is None:
                continue
            req.inflight -= 1
            req.spec_unseen -= draft
            if req.phase is Phase.DONE:
                continue  # finished or aborted while this step was in flight
            if token == SKIPPED_TOKEN:
                raise RuntimeError(f"the engine dropped the row of {req.rid}, which is running")
            if block:
                self._commit_block(req, block, out)
                continue
            req.output.append(token)
            # A finished grammar ends its request like a stop token, even with ignore_eos.
            req.finish = Finish("stop", token) if done else self._finish_reason(req, token)
            out.add(req, [token], logprob)
            if req.finish is not None:
                self._ends_here(req)
        return out

    def _ends_here(self, req: Req) -> None:
        """A request that just finished. With a stop token the executor drops its rows still in
        flight (core/step_runner.py), so the last token's KV is never written: only the tokens
        before it are cached. Without overlap that is already all kv_len covers."""
        if req.inflight and req.finish is not None and req.finish.reason == "stop":
            req.kv_len = min(req.kv_len, len(req.key_tokens) - 1)
        if self.demand is not None:
            self.demand.note(len(req.prompt) - req.cached_tokens, len(req.output))
        self._finish(req)

    def _commit_block(self, req: Req, block: list[int], out: Outputs) -> None:
        """A verify row's tokens: the accepted drafts (their KV is kept) and the correction or
        bonus token, cut at the first one that ends the request; the KV pages past the kept
        positions — and past the blocks of its verify steps still in flight — go back."""
        req.kv_len += len(block) - 1
        emitted: list[int] = []
        for token in block:
            req.output.append(token)
            emitted.append(token)
            req.finish = self._finish_reason(req, token)
            if req.finish is not None:
                break
        self.spec_accept_counts[len(block)] = self.spec_accept_counts.get(len(block), 0) + 1
        req.spec_steps += 1
        req.spec_tokens += len(block)
        out.add(req, emitted, None, accepted=len(block))
        if req.finish is not None:
            self._ends_here(req)
            return
        held = req.kv_len + req.spec_unseen
        keep = max(-(-held // self.page_size), len(req.match.pages) if req.match else 0)
        if len(req.pages) > keep:
            self.cache.free_tail(req.pages[keep:])
            del req.pages[keep:]
            req.pages_synced = min(req.pages_synced, keep)

    def take_errors(self) -> Outputs | None:
        """Errors waiting for the next processed step, now (None when there are none)."""
        if not self.pending_errors.errors:
            return None
        out, self.pending_errors = self.pending_errors, Outputs()
        return out

    def fail_step(self, step: int, message: str) -> Outputs:
        """A step raised: fail the requests it carried."""
        out, self.pending_errors = self.pending_errors, Outputs()
        self.inflight_drafts.pop(step, None)
        for req in self.inflight.pop(step, []):
            if req is not None and req.phase is not Phase.DONE:
                out.fail(req, f"engine step failed: {message}", 500)
                req.finish = Finish("error", message)
                self._finish(req)
        return out

    def _fail(self, req: Req, message: str, code: int) -> None:
        """Fail a request that has no step in flight (its error goes out with the next
        outputs)."""
        if req.phase is Phase.DONE:
            return
        self.pending_errors.fail(req, message, code)
        req.finish = Finish("error", message)
        self._finish(req)

    def _finish_reason(self, req: Req, token: int) -> Finish | None:
        if token in req.stop_ids:
            return Finish("stop", token)
        if len(req.output) >= req.max_new:
            return Finish("length")
        return None

    def _finish(self, req: Req) -> None:
        if req.phase is Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.phase = Phase.DONE
        self.by_rid.pop(req.rid, None)

    def _release(self, req: Req) -> None:
        if req.match is not None:
            # Only tokens whose KV is written (or being written by a step in flight) are cached.
            self.cache.release(req.key_tokens[: req.kv_len], req.pages, req.match)
        if req.slot is not None:
            self.slots.free(req.slot)
        if req in self.running:
            self.running.remove(req)
        req.match, req.pages, req.slot = None, [], None
