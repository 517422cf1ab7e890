"""One engine step with speculative decoding on, on the executor thread: propose, run the
target once, verify, commit.

With speculation on every step comes here (`StepRunner` hands it over), because every target
forward — prefill chunks too — feeds the draft: the residual streams of the draft's target
layers are captured for each new token, and those of committed tokens become draft KV.

A verify row (a `SeqStep` with `draft` > 0) is [anchor, d_1..d_γ]: the anchor is the slot's
last sampled token (the runner's device table put it there), the drafts come from one batched
proposal over every verify row of the step. The target's logits at all γ + 1 positions are
verified (core/spec/verify.py): greedy rows by argmax matching, sampled rows by per-token
rejection or block verification on the target's processed probabilities against the draft's
(its Markov-corrected logits at the request's temperature). Rows that only prefill or decode
one token are sampled as without speculation, by the runner. The KV of rejected drafts stays
where it was written; the scheduler frees the pages past the kept length. A step of verify rows
only replays a CUDA graph of the target forward when one was captured (verify_graphs.py).

Overlap: the scheduler plans step N+1 before it has seen step N's verdict, so a decode or
verify row's planned start may lag by the drafts step N accepted; `lengths` (core/spec/lengths.py)
holds each slot's committed length on this thread and the runner starts every such row there.
A row whose request ended inside step N's block (a stop token among the committed tokens) is
dropped by the runner and comes back as SKIPPED_TOKEN, as without speculation.

A seeded sampled request draws its drafts and acceptance coins from a stream of its own, which
restarts when the request does: after a retraction its continuation is a valid sample, but not
the one it would have drawn without the retraction (a verify step's draw count varies).

Tensor parallelism: the draft is replicated, and every rank runs it (its embedding and logits
are the target's vocab-parallel ones, whose collectives need every rank) on the same target
features, which are full-width on every rank after the target's all-reduces. Rank 0 decides,
the others follow (`runner.share`, core/ranks.py `TokenShare`): its drafts replace theirs
before the target pass (a sampled draft's draw, or an argmax tie under a different reduction
order, need not agree), and its verdicts replace the verification they skip. So every rank
writes the same tokens' KV and draft KV, and the pages past the kept length are rank 0's
scheduler's to free, as for any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from m3serve.core.spec.lengths import SlotLengths
from m3serve.core.spec.proposer import Proposer
from m3serve.core.spec.settings import SpecSettings
from m3serve.core.spec.verify import (
    Verdict,
    accept_length_override,
    override_length,
    verify_greedy,
    verify_sampled,
)
from m3serve.core.spec.verify_graphs import VerifyGraphs
from m3serve.kernels.sampling import MIN_TEMPERATURE, filter_probs_batch
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark_paged import target_pass
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import (
    SKIPPED_TOKEN,
    SamplingParams,
    SeqStep,
    StepResult,
    TokenLogprob,
)

if TYPE_CHECKING:
    from m3serve.core.hicache.copier import LayerLoad
    from m3serve.core.ranks import TokenShare
    from m3serve.core.step_runner import StepRunner

_SEED_MASK = (1 << 64) - 1
# The draft's and the verifier's draws of a seeded request: a stream apart from the sampler's.
_SPEC_STREAM = 0x5BEC


class SpecStep:
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        proposer: Proposer,
        settings: SpecSettings,
        num_slots: int,
    ) -> None:
        self.model, self.kv, self.proposer, self.settings = model, kv, proposer, settings
        self.layer_ids = proposer.layer_ids
        self.gamma = settings.block_size
        self._params: list[SamplingParams] = [SamplingParams()] * num_slots
        self._generators: list[torch.Generator | None] = [None] * num_slots
        # Each slot's committed KV length: the start of its next decode or verify row.
        self.lengths = SlotLengths(num_slots)
        # CUDA graphs of verify-only steps (SpecPlugin.capture_graphs, hopper); None: eager.
        self.graphs: VerifyGraphs | None = None
        self._override_steps = 0  # verify steps so far under the accept-length override

    def start(self, slot: int, params: SamplingParams) -> None:
        """A request starts in `slot`: its sampling settings and, if seeded, its own stream."""
        self._params[slot] = params
        self._generators[slot] = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device)
            self._generators[slot] = generator.manual_seed(
                (params.seed ^ _SPEC_STREAM) & _SEED_MASK
            )

    def run(
        self,
        step: int,
        seqs: list[SeqStep],
        batch: ForwardBatch,
        runner: StepRunner,
        sampled: list[int],
        load: LayerLoad | None = None,
        layers: Sequence[int] | None = None,
    ) -> StepResult:
        """One step over `seqs` (the plan's live rows, starts resolved by `lengths`); the
        result covers `sampled`, the slots of every row the plan samples, dropped ones too.
        `load`: the step's HiCache load-backs, copied layer by layer as the target pass
        reaches each layer; the draft's layers come last, after the pass (no verify row of
        this step reads them: loaded pages belong to requests that start prefilling now).
        `layers`: only those target layers (the warm-up), never through a graph."""
        starts = _row_starts(seqs)
        verify = [i for i, seq in enumerate(seqs) if seq.draft]
        for i in verify:
            if seqs[i].draft != self.gamma:
                raise ValueError(
                    f"a verify row of {seqs[i].draft} drafts; this engine drafts {self.gamma}"
                )
        share = runner.share
        drafts, draft_logits = self._propose(seqs, verify, starts, batch, share)
        plain = [i for i, seq in enumerate(seqs) if seq.sample and not seq.draft]
        rows = [starts[i] + seqs[i].extend - 1 for i in plain]
        rows += [starts[i] + k for i in verify for k in range(self.gamma + 1)]
        if layers is None and self.graphs is not None and self.graphs.fits(seqs, batch):
            if load is not None:
                load.wait_all()  # a replayed graph has no per-layer hook
            # Verify rows only: `rows` is every row in order, as the graph's logits are.
            logits, features = self.graphs.run(batch)
        else:
            before_layer = load.before_layer if load is not None else None
            hidden, features = target_pass(
                self.model, batch, self.kv, self.layer_ids, before_layer, layers
            )
            if load is not None:
                load.wait_all()  # the draft's layers too
            index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden[index])
        plain_slots = [seqs[i].slot for i in plain]
        sampled_rows = runner.sample_rows(logits[: len(plain)], plain_slots) if plain else None
        verdict = None
        if verify:
            target = logits[len(plain) :].view(len(verify), self.gamma + 1, -1)
            slots = [seqs[i].slot for i in verify]
            if share is None or share.leader:
                verdict = self._verify(drafts, draft_logits, target, slots)
            if share is not None:
                verdict = self._shared_verdict(verdict, len(verify), share)
            if sampled_rows is None:  # else sample_rows told the runner already
                runner.launched()
        committed = self._advance_lengths(seqs, verify, verdict)
        self._commit_features(seqs, starts, committed, batch, features)
        return self._result(step, seqs, plain, verify, sampled_rows, verdict, runner, sampled)

    # ------------------------------------------------------------------ propose

    def _propose(
        self,
        seqs: list[SeqStep],
        verify: list[int],
        starts: list[int],
        batch: ForwardBatch,
        share: TokenShare | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [R, γ] for the verify rows (rank 0's with `share`), written into the
        batch after each anchor; and the draft logits [R, γ, V] (None when the proposer has
        none; a follower's own, which it never uses)."""
        device = batch.input_ids.device
        if not verify:
            return torch.empty(0, self.gamma, dtype=torch.int64, device=device), None
        anchor_rows = torch.tensor([starts[i] for i in verify], device=device)
        slots = [seqs[i].slot for i in verify]
        temperatures = [self._temperature(slot) for slot in slots]
        proposal = self.proposer.propose(
            batch.input_ids[anchor_rows],
            [seqs[i].start for i in verify],
            batch.page_table[torch.tensor(verify, device=device)],
            temperatures,
            [self._generators[slot] for slot in slots],
        )
        tokens = proposal.tokens if share is None else share.share_ids(proposal.tokens)
        offsets = torch.arange(1, self.gamma + 1, device=device)
        batch.input_ids[anchor_rows[:, None] + offsets] = tokens
        return tokens, proposal.logits

    def _temperature(self, slot: int) -> float:
        params = self._params[slot]
        return 0.0 if params.greedy else max(params.temperature, MIN_TEMPERATURE)

    # ------------------------------------------------------------------ verify

    def _verify(
        self,
        drafts: torch.Tensor,
        draft_logits: torch.Tensor | None,
        target: torch.Tensor,
        slots: list[int],
    ) -> Verdict:
        override = self.settings.accept_length_override
        if override:
            length = override_length(override, self._override_steps)
            self._override_steps += 1
            return accept_length_override(drafts, target, length)
        accept = torch.empty(len(slots), dtype=torch.int64, device=drafts.device)
        tokens = torch.empty(len(slots), self.gamma + 1, dtype=torch.int64, device=drafts.device)
        greedy = [r for r, slot in enumerate(slots) if self._params[slot].greedy]
        if greedy:
            index = torch.tensor(greedy, device=drafts.device)
            verdict = verify_greedy(drafts[index], target[index])
            accept[index], tokens[index] = verdict.accept_len, verdict.tokens
        method = "block" if self.settings.block_verification else "tokenwise"
        for r, slot in enumerate(slots):
            if r in greedy:
                continue
            # Row by row: each seeded request draws from its own stream.
            q = None
            if draft_logits is not None:
                q = torch.softmax(draft_logits[r : r + 1] / self._temperature(slot), dim=-1)
            p = self._target_probs(target[r], self._params[slot])[None]
            verdict = verify_sampled(
                drafts[r : r + 1], p, q, None, method, generator=self._generators[slot]
            )
            accept[r], tokens[r] = verdict.accept_len[0], verdict.tokens[0]
        return Verdict(accept, tokens)

    def _shared_verdict(self, verdict: Verdict | None, rows: int, share: TokenShare) -> Verdict:
        """Rank 0's `verdict` on every rank (a follower passes None): accept lengths and
        tokens in one broadcast of [rows, 1 + γ + 1]."""
        if verdict is not None:
            packed = torch.cat((verdict.accept_len[:, None], verdict.tokens), dim=1)
        else:
            packed = torch.empty(rows, self.gamma + 2, dtype=torch.int64, device=self.model.device)
        packed = share.share_ids(packed)
        return Verdict(packed[:, 0].contiguous(), packed[:, 1:].contiguous())

    def _target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[γ+1, V]: the target's distribution at each block position, as the sampler draws:
        temperature, then top-k / top-p / min-p, renormalized."""
        vocab = logits.shape[-1]
        probs = torch.softmax(logits.float() / max(params.temperature, MIN_TEMPERATURE), dim=-1)
        top_k = params.top_k if 0 < params.top_k < vocab else vocab
        if top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0:
            n = probs.shape[0]
            probs = filter_probs_batch(
                probs,
                torch.full((n,), top_k, dtype=torch.int64, device=probs.device),
                torch.full((n,), params.top_p, device=probs.device),
                torch.full((n,), params.min_p, device=probs.device),
            )
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    # ------------------------------------------------------------------ commit

    def _advance_lengths(
        self, seqs: list[SeqStep], verify: list[int], verdict: Verdict | None
    ) -> list[int]:
        """Per seq, the tokens whose KV this step keeps (prompt chunks and plain decode inputs
        all of theirs, a verify row its anchor and accepted drafts); each slot's committed length
        moves on by as many."""
        committed = [seq.extend for seq in seqs]
        if verdict is not None:
            for i, accepted in zip(verify, verdict.accept_len.tolist(), strict=True):
                committed[i] = 1 + accepted
        for seq, count in zip(seqs, committed, strict=True):
            self.lengths.advance(seq, count)
        return committed

    def _commit_features(
        self,
        seqs: list[SeqStep],
        starts: list[int],
        committed: list[int],
        batch: ForwardBatch,
        features: torch.Tensor,
    ) -> None:
        """Draft KV for the tokens this step committed (rejected drafts never)."""
        rows: list[int] = []
        for start, count in zip(starts, committed, strict=True):
            rows.extend(range(start, start + count))
        index = torch.tensor(rows, dtype=torch.int64, device=features.device)
        self.proposer.commit(features[index], batch.positions[index], batch.out_slots[index])

    def _result(
        self,
        step: int,
        seqs: list[SeqStep],
        plain: list[int],
        verify: list[int],
        sampled_rows: tuple[list[int], list[TokenLogprob | None], list[bool]] | None,
        verdict: Verdict | None,
        runner: StepRunner,
        sampled: list[int],
    ) -> StepResult:
        """The rows in plan order (the scheduler's): plain rows' tokens from the runner, verify
        rows' committed tokens, the last of which is the slot's next anchor; SKIPPED_TOKEN for
        the rows the runner dropped."""
        by_slot: dict[int, tuple[int, TokenLogprob | None, bool, list[int]]] = {}
        if sampled_rows is not None:
            ids, logprobs, ended = sampled_rows
            for n, i in enumerate(plain):
                by_slot[seqs[i].slot] = (ids[n], logprobs[n], ended[n] if ended else False, [])
        if verdict is not None:
            accepted = verdict.accept_len.tolist()
            for n, (i, row) in enumerate(zip(verify, verdict.tokens.tolist(), strict=True)):
                block = row[: accepted[n] + 1]
                by_slot[seqs[i].slot] = (block[-1], None, False, block)
                runner.note_committed(seqs[i].slot, block)
        dropped = (SKIPPED_TOKEN, None, False, [])
        rows = [by_slot.get(slot, dropped) for slot in sampled]
        return StepResult(
            step=step,
            slots=sampled,
            tokens=[r[0] for r in rows],
            logprobs=[r[1] for r in rows],
            grammar_ended=[r[2] for r in rows],
            spec_tokens=[r[3] for r in rows] if verify else [],
        )


def _row_starts(seqs: list[SeqStep]) -> list[int]:
    starts, row = [], 0
    for seq in seqs:
        starts.append(row)
        row += seq.extend
    return starts
