"""The executor: owns the model, the KV tensors and the sampler on one device and runs one
`StepPlan` at a time, on its own thread.

Sampled tokens stay in a per-slot table on the device (`last_tokens`), so the scheduler can plan
step N+1 — whose decode inputs are "whatever slot s sampled last" — before it has seen step N's
tokens. Plans run strictly in order, so a page freed after step N and reused by step N+2 is
never written by a step that is still in flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from dataclasses import dataclass

import torch

from m3serve.kernels.sampling import Sampler
from m3serve.model.batch import ForwardBatch, SeqChunk
from m3serve.model.build import LoadedModel
from m3serve.model.kv_cache import KVCache
from m3serve.runtime.messages import StepPlan, StepResult

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_TOKENS = 65536


@dataclass(frozen=True)
class KVBudget:
    num_pages: int
    page_size: int

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size


def plan_kv_budget(
    loaded: LoadedModel,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    kv_dtype: torch.dtype,
    max_useful_tokens: int | None = None,
) -> KVBudget:
    """How many KV pages to allocate: an explicit token count, else what fits on the device,
    but never more than `max_useful_tokens` (every running request at full context)."""
    cfg = loaded.model.cfg
    page = cfg.page_size
    if max_total_tokens is not None:
        return KVBudget(-(-max_total_tokens // page), page)
    if loaded.device.type != "cuda":
        return KVBudget(DEFAULT_CPU_KV_TOKENS // page, page)
    free, total = torch.cuda.mem_get_info(loaded.device)
    # Weights are already resident; the KV pool takes what the static fraction leaves.
    budget = free - total * (1.0 - mem_fraction_static)
    pages = int(budget // KVCache.bytes_per_page(cfg, kv_dtype))
    if max_useful_tokens is not None:
        # A small model on a big GPU would otherwise get a pool of tens of millions of pages.
        pages = min(pages, -(-max_useful_tokens // page))
    if pages < 2:
        raise RuntimeError(
            f"no memory left for the KV cache ({free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB); raise --mem-fraction-static or set --max-total-tokens"
        )
    return KVBudget(pages, page)


def leave_a_core_for_the_scheduler() -> None:
    """On CPU the executor thread's intra-op workers and the scheduler's event loop share the
    cores; oversubscribed, every torch op slows several-fold (measured 3.5x on 2 cores)."""
    threads = max(1, (os.cpu_count() or 2) - 1)
    if torch.get_num_threads() > threads:
        log.info("CPU executor: torch intra-op threads %d -> %d", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)


class Executor:
    def __init__(
        self,
        loaded: LoadedModel,
        budget: KVBudget,
        max_slots: int,
        kv_dtype: torch.dtype,
        graph_max_bs: int = 0,
        context_length: int | None = None,
    ) -> None:
        self.model = loaded.model
        self.device = loaded.device
        cfg = self.model.cfg
        # One page past the pool is scratch: CUDA-graph padding rows write there.
        self.kv = KVCache.allocate(cfg, budget.num_pages + 1, kv_dtype, self.device)
        self.sampler = Sampler(max_slots, cfg.vocab_size, self.device)
        self.last_tokens = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self.graphs = None
        if graph_max_bs > 0 and loaded.backend.name == "hopper":
            from m3serve.backends.hopper.graphs import DecodeGraphs

            context = context_length or cfg.max_position_embeddings
            max_pages = min(-(-context // cfg.page_size), budget.num_pages)
            self.graphs = DecodeGraphs(
                self.model, self.kv, budget.num_pages, min(graph_max_bs, max_slots), max_pages
            )
            self.graphs.capture()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        for seq in plan.seqs:
            if seq.new_request:
                self.sampler.start(
                    seq.slot,
                    plan.sampling[seq.slot],
                    plan.prompt_ids[seq.slot],
                    plan.output_ids.get(seq.slot, ()),
                )
        chunks = [
            SeqChunk(seq.input_ids or [0] * seq.extend, seq.start, seq.pages) for seq in plan.seqs
        ]
        batch = ForwardBatch.build(chunks, self.model.cfg.page_size, self.device)
        self._fill_slot_tokens(plan, batch)
        rows = [i for i, seq in enumerate(plan.seqs) if seq.sample]
        if self.graphs is not None and len(rows) == len(plan.seqs) and self.graphs.fits(batch):
            logits = self.graphs.run(batch)
        else:
            hidden = self.model.hidden_states(batch, self.kv)
            if not rows:
                return StepResult(step=plan.step, slots=[], tokens=[])
            logits = self.model.compute_logits(hidden[batch.logit_rows[rows]])
        slots = [plan.seqs[i].slot for i in rows]
        tokens, logprobs = self.sampler.sample(logits, slots)
        self.last_tokens[torch.tensor(slots, device=self.device)] = tokens
        return StepResult(step=plan.step, slots=slots, tokens=tokens.tolist(), logprobs=logprobs)

    def _fill_slot_tokens(self, plan: StepPlan, batch: ForwardBatch) -> None:
        """Decode inputs the CPU has not seen yet come from the device-side token table."""
        rows, slots, row = [], [], 0
        for seq in plan.seqs:
            if seq.input_ids is None:
                rows.append(row)
                slots.append(seq.slot)
            row += seq.extend
        if rows:
            index = torch.tensor(slots, device=self.device)
            batch.input_ids[torch.tensor(rows, device=self.device)] = self.last_tokens[index]


class ExecutorThread:
    """Runs plans in submission order on one background thread; results come back as futures."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._queue: queue.Queue[tuple[StepPlan, concurrent.futures.Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="m3serve-executor", daemon=True)
        self._thread.start()

    def submit(self, plan: StepPlan) -> concurrent.futures.Future[StepResult]:
        future: concurrent.futures.Future[StepResult] = concurrent.futures.Future()
        self._queue.put((plan, future))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            plan, future = item
            if not future.set_running_or_notify_cancel():
                continue  # the scheduler gave up on this step (shutting down)
            try:
                future.set_result(self.executor.run(plan))
            except BaseException as exc:  # the scheduler decides what a failed step means
                log.exception("step %d failed", plan.step)
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        # Drop the model and KV now: an embedding process may start another engine next.
        del self.executor
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
