"""StepRunner: what the executor thread does with one StepPlan.

It builds the forward batch (or, for a plain decode step that a CUDA graph holds, hands the
graph the step's rows as they are: `_decode_rows`), picks how the forward runs (a decode CUDA
graph, piecewise graphs around eager attention, or eagerly), runs a step's HiCache load-backs
layer by layer inside it, draws each sampled row's token (core/step_draw.py: inside a graph
where the rows need nothing but the draw) and keeps the per-slot state that lives on this
thread: the sampler's, the grammar matchers', the device table of each slot's last token (the
next decode input, before the CPU has seen it) and which slots just sampled the token that ends
their request. Everything here runs on the executor thread; the engine core plans on its event loop.

Under overlap a step is planned before the CPU has seen the tokens of the step before it, so it
may hold decode rows of requests that have just ended (their stop token, or their grammar's end).
Without speculation such a *dead* row runs with the rest and its draw is discarded: the batch
built ahead stays valid, and under --tp the followers, which may already be running the plan,
run the same rows. A step whose rows are all dead runs no forward on a lone rank. Speculative
steps drop dead rows instead (their verify rows' lengths move with the drafts accepted).

On a GPU (--launch-ahead auto) a step is also *launched ahead* where it can be: its kernels are
queued while the step before it still runs (core/step_ahead.py).

With tensor parallelism every rank runs the same plans through its own StepRunner, and `share`
makes each sampled step's tokens rank 0's on every rank (core/ranks.py `TokenShare`): a follower
takes them on the device as its next decode inputs and draws none itself, so it never waits for
its device and its steps queue behind rank 0's plans alone; only rank 0 encodes images, and
`media_share` hands their features to the other ranks (`MediaShare`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from m3serve.core.device_clock import DeviceSpan, seconds_of, start_span
from m3serve.core.graphs import DecodeGraphs, DecodeRows, StepInput
from m3serve.core.head_draw import HeadDraws
from m3serve.core.hicache.copier import LayerLoad
from m3serve.core.hicache.tier import HostTier
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.media import ReqMedia, step_embeds
from m3serve.core.piecewise import PiecewiseGraphs
from m3serve.core.ranks import MediaShare, TokenShare
from m3serve.core.sampler import Sampler
from m3serve.core.step_ahead import LaunchedAhead, StepsAhead, step_result
from m3serve.core.step_draw import StepDraws
from m3serve.model.batch import ForwardBatch
from m3serve.model.host_copy import Download, upload
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import (
    SKIPPED_TOKEN,
    SamplingParams,
    SeqStep,
    StepPlan,
    StepResult,
    TokenLogprob,
)

if TYPE_CHECKING:
    from m3serve.core.grammar import Grammar
    from m3serve.core.spec.verify_step import SpecStep


class StepRunner(StepsAhead, StepDraws):
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        page_size: int,
        sampler: Sampler,
        matchers: GrammarMatchers,
        step_grammars: dict[int, dict[int, Grammar]],
        host: HostTier | None,
        step_media: dict[int, dict[int, list[ReqMedia]]] | None = None,
    ) -> None:
        """`step_grammars`: the engine core's hand-over of compiled grammars, by step, to the
        run that starts their slots; `step_media` likewise of the images each step's prefill
        chunks need, by slot. The CUDA graphs are set once captured (after warm-up)."""
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.device = model.device
        self.sampler = sampler
        self.matchers = matchers
        self.step_grammars = step_grammars
        self.host = host
        self.step_media = step_media if step_media is not None else {}
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.heads: HeadDraws | None = None  # the piecewise steps' draw (core/head_draw.py)
        # Each slot's page list on the device, when the scheduler sends page deltas (set by
        # the engine core); without it every row carries its whole list.
        self.slot_pages: SlotPages | None = None
        # Set by a tensor-parallel engine core.
        self.share: TokenShare | None = None
        self.media_share: MediaShare | None = None
        # Speculative decoding (set by the engine core): every step runs through it.
        self.spec: SpecStep | None = None
        # One entry per slot, and a scratch one past them that CUDA graphs' padding rows write.
        self.last_tokens = torch.zeros(sampler.num_slots + 1, dtype=torch.int64, device=self.device)
        # Each slot's stop ids, and the slots whose last sampled token ended their request
        # (their rows in a step planned before the CPU saw it are dropped).
        self._stops: dict[int, frozenset[int]] = {}
        self._ended: set[int] = set()
        self._timing_slots = 0  # slots 0.. started by `time_step`
        # Called once a sampled step's kernels are queued, with a check of whether the device
        # has finished them, before the host waits for its tokens: the executor hands over the
        # previous step's result there and builds the next step's batch (core/executor.py).
        self.while_device_runs: Callable[[Callable[[], bool]], None] | None = None
        # A batch built by `prepare` before its step ran: (step, the slots of its rows, batch).
        self._prepared: tuple[int, list[int], StepInput] | None = None
        # Whether `prepare` launches the steps it can (--launch-ahead; set by the engine core),
        # and the step it launched, until its run takes its tokens.
        self.launch_ahead = False
        self._ahead: LaunchedAhead | None = None
        # perf_counter() when the last sampled step's kernels were all queued (0: none since
        # the caller reset it): the step trace's launch time.
        self.launched_at = 0.0
        self.launched_cpu = 0.0  # time.thread_time() then: the trace's `cpu=`
        # Seconds the last step spent building its batch itself (0: `prepare` had built it
        # ahead, while the step before ran): part of its launch, the step trace's `build=`.
        self.build_seconds = 0.0
        # The device time of the last sampled step's kernels, from its first to its draw
        # (core/device_clock.py; None: a CPU, or not known), and the span of the step running.
        self.device_seconds: float | None = None
        self._span: DeviceSpan | None = None

    @torch.inference_mode()
    def run(self, plan: StepPlan, layers: Sequence[int] | None = None) -> StepResult:
        """One forward over the plan's tokens (only `layers`, for the warm-up), and a sampled
        token for each seq that asks."""
        self.device_seconds, self._span = None, None
        ahead = self._ahead
        if ahead is not None and ahead.plan is plan and layers is None:
            self._ahead = None
            return self._finish_ahead(ahead)
        if plan.backups and self.host is not None:  # a follower rank: rank 0's backups
            self.host.mirror_backups(plan.backups)
        self._start_new_requests(plan)
        load = self.host.start_loads(plan) if self.host is not None else None
        try:
            return self._forward(plan, layers, load)
        finally:
            if load is not None:
                load.finish()  # also after a failed forward: nobody may wait on it forever

    @torch.inference_mode()
    def time_step(self, seqs: list[SeqStep], sampling: SamplingParams | None = None) -> None:
        """One step as a request sees it, for measuring (core/step_cost.py): building the
        batch, the forward, and for a decode the draw of every row's token and its copy to the
        host. Uses slots 0..len(seqs)-1 with `sampling` (the checkpoint's defaults, which a
        request that sets nothing gets: a top-p draw costs more than a plain one); a request's
        start resets them.
        A slot is started once, on the first (untimed) call that uses it: a request starts its
        slot once, not every step (starting every slot each call put a batch-128 decode step at
        9.7 ms on the H200, where served ones took 6.0)."""
        if not all(seq.extend == 1 for seq in seqs):
            self.logits(ForwardBatch.build(seqs, self.page_size, self.device), decode_only=False)
            return
        slots = list(range(len(seqs)))
        for slot in range(self._timing_slots, len(seqs)):
            self.sampler.start(slot, sampling or SamplingParams(), [1])
        self._timing_slots = max(self._timing_slots, len(seqs))
        # As served: the rows on those slots, their inputs the slots' last tokens.
        rows = [
            msgspec.structs.replace(seq, input_ids=None, slot=slot, page_start=0)
            for slot, seq in zip(slots, seqs, strict=True)
        ]
        batch: StepInput | None = self._decode_rows(rows)
        if batch is None:
            batch = ForwardBatch.build(seqs, self.page_size, self.device)
        drawn = self._graph_draw(batch, slots, len(seqs), None, None)
        if drawn is None:
            drawn = self.sampler.sample(self.logits(batch, decode_only=True), slots)
        drawn[0].tolist()

    def logits(
        self, batch: StepInput, decode_only: bool, load: LayerLoad | None = None
    ) -> torch.Tensor:
        if isinstance(batch, DecodeRows):
            assert self.graphs is not None, "decode rows are given only to a graph that holds them"
            if load is not None:
                load.wait_all()
            return self.graphs.run(batch)
        if batch.override_rows is not None:  # image features: graphs embed tokens themselves
            before_layer = load.before_layer if load is not None else None
            return self.model(batch, self.kv, before_layer=before_layer)
        if self.graphs is not None and decode_only and self.graphs.fits(batch):
            if load is not None:
                load.wait_all()  # a replayed graph has no per-layer hook
            return self.graphs.run(batch)
        before_layer = load.before_layer if load is not None else None
        if self.piecewise is not None and self.piecewise.fits(batch):
            hidden = self.piecewise.run(batch, before_layer)
            return self.model.compute_logits(hidden[batch.logit_rows])
        return self.model(batch, self.kv, before_layer=before_layer)

    # ------------------------------------------------------------------ one step

    def _forward(
        self, plan: StepPlan, layers: Sequence[int] | None, load: LayerLoad | None
    ) -> StepResult:
        sampled = [seq.slot for seq in plan.seqs if seq.sample]
        self.build_seconds = 0.0
        seqs, dead = self._rows(plan.seqs)
        if not seqs:  # load-backs only, or every row's request ended on the step before
            return step_result(plan.step, sampled, [], [], [], [])
        # With speculation every step, the warm-up's too, takes the spec path real steps take.
        spec = self.spec
        if spec is not None:
            # Overlap: a decode's planned start lags by the drafts accepted since it was planned.
            seqs = spec.lengths.resolve(seqs)
        batch = self._take_prepared(plan.step, seqs)
        if batch is None:
            started = time.perf_counter()
            batch = self._build(seqs, rows=layers is None and plan.step not in self.step_media)
            self.build_seconds = time.perf_counter() - started
        self._span = start_span(self.device) if sampled else None
        batch = self._with_media(plan, seqs, batch)
        if spec is not None:
            return spec.run(plan.step, seqs, batch, self, sampled, load, layers)
        slots = [seq.slot for seq in seqs if seq.sample]
        follower = self.share is not None and not self.share.leader
        if layers is None and slots and not follower:
            tokens, logprobs = self._draw(batch, slots, len(seqs), load, self._span)
            ids, logprobs, ended = self._take_rows(tokens, logprobs, slots, dead)
            return step_result(plan.step, sampled, slots, ids, logprobs, ended)
        if layers is None:
            logits = self.logits(batch, len(slots) == len(seqs), load)
        else:
            logits = self.model(batch, self.kv, layers)
        if not slots:
            return step_result(plan.step, sampled, [], [], [], [])
        if follower:
            self._take_leader_tokens(slots)
            return StepResult(step=plan.step, slots=[], tokens=[])
        ids, logprobs, ended = self.sample_rows(logits, slots, dead)
        return step_result(plan.step, sampled, slots, ids, logprobs, ended)

    def _take_leader_tokens(self, slots: list[int]) -> None:
        """A follower (no speculation): rank 0's sampled tokens become these slots' next decode
        inputs on the device, from a broadcast of the device group queued behind the forward.
        It draws none itself and never waits for its device: only rank 0 needs the tokens on
        the host (for the requests, the grammars and the rows that end), and rank 0 runs the
        rows of requests that ended as dead rows, as this rank does, so no plan changes."""
        assert self.share is not None
        index = upload(slots, torch.int64, self.device)
        mine = torch.empty(len(slots), dtype=torch.int64, device=self.device)
        self.last_tokens[index] = self.share.share_ids(mine)

    def _build(self, seqs: list[SeqStep], rows: bool) -> StepInput:
        """The step's input: with `rows` its rows as they are where a decode graph takes them
        (`_decode_rows`), else its forward batch."""
        decode = self._decode_rows(seqs) if rows else None
        if decode is not None:
            return decode
        return ForwardBatch.build(
            seqs, self.page_size, self.device, slot_pages=self.slot_pages,
            slot_tokens=self.last_tokens,
        )  # fmt: skip

    def _decode_rows(self, seqs: list[SeqStep]) -> DecodeRows | None:
        """`seqs` as the rows of a decode graph (core/graphs.py `DecodeRows`): plain decode
        rows (their tokens on the device) of a lone rank without speculation, that a graph
        holds; else None. Their page changes are applied to the slots' lists first."""
        graphs, lists = self.graphs, self.slot_pages
        if graphs is None or lists is None or self.share is not None or self.spec is not None:
            return None
        if any(s.input_ids is not None or s.draft for s in seqs):
            return None
        held = np.fromiter((s.num_pages for s in seqs), np.int64, len(seqs))  # after the update
        most = int(held.max())
        if not graphs.holds(len(seqs), most):
            return None
        slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
        positions = np.fromiter((s.start for s in seqs), np.int64, len(seqs))
        index = positions // self.page_size  # the page each row's new token goes to
        short = np.flatnonzero(held <= index)
        if len(short):
            row = int(short[0])
            raise ValueError(
                f"slot {int(slots[row])}: a token at position {int(positions[row])} needs "
                f"{int(index[row]) + 1} pages, the slot holds {int(held[row])}"
            )
        lists.update(seqs)
        out_slots = lists.host[slots, index] * self.page_size + positions % self.page_size
        return DecodeRows(positions, out_slots, slots, self.last_tokens, lists.table, most)

    def sample_rows(
        self, logits: torch.Tensor, slots: list[int], dead: frozenset[int] = frozenset()
    ) -> tuple[list[int], list[TokenLogprob | None], list[bool]]:
        """Each row's token (logits [len(slots), V]), its logprob and whether its grammar
        ended; the slots' device-side last tokens are set to them. The `dead` slots' requests
        have ended: their rows are drawn (under --tp rank 0 shares every row's token) and come
        back as SKIPPED_TOKEN."""
        tokens, logprobs = self._queue_draw(logits, slots, self._span)
        return self._take_rows(tokens, logprobs, slots, dead)

    def _take_rows(
        self,
        tokens: torch.Tensor,
        logprobs: list[TokenLogprob | None],
        slots: list[int],
        dead: frozenset[int],
    ) -> tuple[list[int], list[TokenLogprob | None], list[bool]]:
        """`sample_rows` once the rows' draw is queued: the tokens on the host, settled."""
        # A step launched ahead in `launched` queues behind this one: only a copy queued now
        # leaves these tokens ahead of it (without that, `tolist` waits for nothing more).
        copy = Download(tokens) if self.launch_ahead else tokens
        self.launched()
        ids, ended = self._settle(slots, self._take_tokens(slots, copy, dead))
        self.device_seconds = seconds_of(self._span)
        return ids, logprobs, ended

    def _settle(self, slots: list[int], ids: list[int]) -> tuple[list[int], list[bool]]:
        """The rows' tokens, on the host, taken by their grammars and stop ids: the tokens
        (rank 0's under --tp with speculation) and whether each row's grammar ended."""
        ended = self.matchers.accept(slots, ids)
        share = self.share
        if share is not None and self.spec is not None:
            # Speculation: every rank goes on with rank 0's tokens, on the host.
            ids, ended = share.share(ids, ended)
            index = upload(slots, torch.int64, self.device)
            self.last_tokens[index] = upload(ids, torch.int64, self.device)
        self._note_ended(slots, ids, ended)
        return ids, ended

    @staticmethod
    def _take_tokens(
        slots: list[int], tokens: Download | torch.Tensor, dead: frozenset[int]
    ) -> list[int]:
        """The drawn tokens on the host; the dead rows' as SKIPPED_TOKEN."""
        ids: list[int] = tokens.tolist()
        if dead:
            ids = [SKIPPED_TOKEN if s in dead else t for s, t in zip(slots, ids, strict=True)]
        return ids

    def launched(self) -> None:
        """A sampled step's kernels are all queued and its host is about to wait for its
        tokens: the executor hands over the previous step's result and builds the next
        step's batch meanwhile, and launches it where it can (`prepare`). Every step with a
        sampled row calls this once."""
        self.launched_at = time.perf_counter()
        self.launched_cpu = time.thread_time()
        if self.while_device_runs is not None:
            self.while_device_runs(_device_done(self.device))

    def note_committed(self, slot: int, tokens: list[int]) -> None:
        """A speculative verify row committed `tokens`: the last is the slot's next input."""
        self.last_tokens[slot] = tokens[-1]
        stops = self._stops.get(slot, ())
        if any(token in stops for token in tokens):
            self._ended.add(slot)
        else:
            self._ended.discard(slot)

    def _with_media(self, plan: StepPlan, seqs: list[SeqStep], batch: StepInput) -> StepInput:
        """The batch with image/video features in place of the placeholder rows it carries
        (a follower rank has no media of its own: it takes rank 0's features). Decode rows
        carry none: a step with images builds its batch."""
        media = self.step_media.pop(plan.step, None)
        encoder = self.model.vision
        embeds = None
        if media and encoder is not None:
            embeds = step_embeds(encoder, seqs, media)
        if self.media_share is not None:
            embeds = self.media_share.share(plan.media_rows, embeds)
        if embeds is None:
            return batch
        assert isinstance(batch, ForwardBatch)
        return batch.with_embeds(*embeds)

    def _start_new_requests(self, plan: StepPlan) -> None:
        grammars = self.step_grammars.pop(plan.step, {})
        for seq in plan.seqs:
            if seq.new_request:
                slot = seq.slot
                output = plan.output_ids.get(slot, ())
                self.sampler.start(slot, plan.sampling[slot], plan.prompt_ids[slot], output)
                if self.spec is not None:
                    self.spec.start(slot, plan.sampling[slot])
                self._stops[slot] = frozenset(plan.stop_ids.get(slot, ()))
                self._ended.discard(slot)
                self.matchers.start(slot, grammars.get(slot), output)

    def _rows(self, seqs: Sequence[SeqStep]) -> tuple[list[SeqStep], frozenset[int]]:
        """The rows this step runs, and the dead ones among them: decode rows of requests that
        ended on the step before (the plan was made before the CPU saw their stop token; this
        thread has). Speculation drops them; a lone rank drops a step of dead rows only."""
        if not self._ended:
            return list(seqs), frozenset()
        dead = frozenset(s.slot for s in seqs if s.input_ids is None and s.slot in self._ended)
        if self.spec is not None:
            return [s for s in seqs if s.input_ids is not None or s.slot not in dead], frozenset()
        if self.share is None and len(dead) == len(seqs):
            return [], frozenset()  # under --tp the followers may be running it already
        return list(seqs), dead

    def _note_ended(self, slots: list[int], ids: list[int], grammar_ended: list[bool]) -> None:
        """Which slots sampled the token that ends their request (what the scheduler will
        conclude when it processes this step)."""
        for row, (slot, token) in enumerate(zip(slots, ids, strict=True)):
            if token == SKIPPED_TOKEN:  # a dead row: its request stays ended
                continue
            if token in self._stops.get(slot, ()) or (grammar_ended and grammar_ended[row]):
                self._ended.add(slot)
                if self._ahead is not None and slot in self._ahead.decoding:
                    self._ahead.dead.add(slot)  # its row there was launched live
            else:
                self._ended.discard(slot)


def _device_done(device: torch.device) -> Callable[[], bool]:
    """Whether the work queued so far on `device` has finished (a CPU runs it as it comes)."""
    if device.type != "cuda":
        return lambda: True
    event = torch.cuda.Event()
    event.record()
    return event.query
