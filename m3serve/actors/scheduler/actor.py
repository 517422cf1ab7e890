"""SchedulerActor: the engine process's event loop around `Scheduler` and the executor.

Messages are received by their own task, so requests and aborts land between steps. The step
loop plans step N+1 and hands it to the executor thread *before* it waits for step N's result
(overlap); with --disable-overlap-schedule it waits for each step before planning the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from m3serve.actors.executor import (
    Executor,
    ExecutorThread,
    leave_a_core_for_the_scheduler,
    plan_kv_budget,
)
from m3serve.actors.scheduler.req import Req
from m3serve.actors.scheduler.scheduler import Outputs, QueueFull, Scheduler
from m3serve.model.build import DTYPES, load_model
from m3serve.runtime.actor import Actor, handles
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import Abort, Error, Shutdown, Stats, Tokenized
from m3serve.runtime.shm import unpack_token_ids
from m3serve.runtime.transport import Inbox, Outbox

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
# With work queued but nothing schedulable (e.g. a retracted request's token in flight) the
# loop re-plans after this long instead of busy-spinning.
IDLE_RECHECK_S = 0.01


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(
        self,
        inbox: Inbox,
        tokenizers: list[Outbox],
        control: Outbox | None,
        args: ServerArgs,
        model_path: Path,
    ) -> None:
        super().__init__(inbox, control)
        self.tokenizers = tokenizers
        self.args = args
        self.model_path = model_path
        self.overlap = not args.sched.disable_overlap_schedule
        self.scheduler: Scheduler | None = None
        self.executor: ExecutorThread | None = None
        self._wake = asyncio.Event()
        self._stats_at = 0.0

    async def on_start(self) -> dict[str, Any]:
        args = self.args
        loaded = await asyncio.to_thread(
            load_model,
            self.model_path,
            args.backend.backend,
            args.model.dtype,
            args.backend.device,
            False,
        )
        if loaded.device.type == "cpu":
            leave_a_core_for_the_scheduler()
        kv_dtype = loaded.dtype
        if args.cache.kv_cache_dtype == "fp8_e4m3":
            kv_dtype = torch.float8_e4m3fn  # scale 1.0: written saturated, read by casting
        elif args.cache.kv_cache_dtype != "auto":
            kv_dtype = DTYPES[args.cache.kv_cache_dtype]
        context = args.runtime.context_length or loaded.model.cfg.max_position_embeddings
        budget = plan_kv_budget(
            loaded,
            args.cache.max_total_tokens,
            args.cache.mem_fraction_static,
            kv_dtype,
            max_useful_tokens=context * args.sched.max_running_requests,
        )
        slots = args.sched.max_running_requests
        kernel = args.kernel
        graph_bs = 0 if kernel.disable_cuda_graph else (kernel.cuda_graph_max_bs_decode or 128)
        executor = Executor(loaded, budget, slots, kv_dtype, graph_bs, args.runtime.context_length)
        self.executor = ExecutorThread(executor)
        self.scheduler = Scheduler(
            args.sched, budget.num_pages, budget.page_size, not args.cache.disable_radix_cache
        )
        log.info("KV pool: %d pages x %d tokens", budget.num_pages, budget.page_size)
        return {
            "max_total_tokens": budget.tokens,
            "page_size": budget.page_size,
            "backend": loaded.backend.name,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "device": str(loaded.device),
            "cuda_graph_bs": executor.graphs.sizes if executor.graphs else [],
        }

    async def on_stop(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    # ------------------------------------------------------------------ messages

    @handles(Tokenized)
    async def on_tokenized(self, msg: Tokenized) -> None:
        assert self.scheduler is not None
        req = Req(
            rid=msg.rid,
            prompt=unpack_token_ids(msg.input_ids).tolist(),
            sampling=msg.sampling,
            stop_ids=frozenset(msg.stop_token_ids),
            worker=msg.worker,
            arrival=msg.arrival,
            max_new=msg.max_new_tokens,
        )
        try:
            self.scheduler.add(req, fit_to_pool=msg.fit_to_pool)
        except QueueFull as exc:
            await self.tokenizers[msg.worker].send(Error(msg.rid, str(exc), 503))
        except ValueError as exc:
            await self.tokenizers[msg.worker].send(Error(msg.rid, str(exc), 400))
        except Exception as exc:
            # A request the scheduler cannot take fails alone; the engine keeps serving.
            log.exception("request %s refused", msg.rid)
            await self.tokenizers[msg.worker].send(Error(msg.rid, repr(exc), 500))

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        assert self.scheduler is not None
        self.scheduler.abort(msg.rid)

    async def _receive(self) -> None:
        while True:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                self.stopping = True
            else:
                await self.dispatch(message)
            self._wake.set()
            if self.stopping:
                return

    # ------------------------------------------------------------------ steps

    async def loop(self) -> None:
        receiver = asyncio.create_task(self._receive(), name="scheduler-receive")
        try:
            await self._steps(receiver)
        finally:
            receiver.cancel()

    async def _steps(self, receiver: asyncio.Task[None]) -> None:
        assert self.scheduler is not None and self.executor is not None
        pending: tuple[int, asyncio.Future[Any]] | None = None
        while not self.stopping:
            if receiver.done():
                receiver.result()  # a crashed receiver is a crashed actor
            # Cleared before planning: a message that lands from here on wakes the idle wait.
            self._wake.clear()
            plan = self.scheduler.schedule()
            launched = None
            if plan is not None:
                launched = (plan.step, asyncio.wrap_future(self.executor.submit(plan)))
            if pending is not None:
                await self._collect(*pending)
            pending = launched
            if pending is not None and not self.overlap:
                await self._collect(*pending)
                pending = None
            if plan is None and pending is None and not self.stopping:
                await self._publish_stats(force=True)
                await self._idle(receiver)
            else:
                await self._publish_stats()
        if pending is not None:
            await self._collect(*pending)

    async def _idle(self, receiver: asyncio.Task[None]) -> None:
        """Sleep until a message arrives (or the receiver dies); re-plan periodically if work
        is queued but could not be scheduled yet."""
        assert self.scheduler is not None
        timeout = IDLE_RECHECK_S if self.scheduler.has_work else None
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({woken, receiver}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()

    async def _collect(self, step: int, future: asyncio.Future[Any]) -> None:
        assert self.scheduler is not None
        try:
            result = await future
        except Exception as exc:
            outputs = self.scheduler.fail_step(step, repr(exc))
        else:
            outputs = self.scheduler.process(result)
        await self._emit(outputs)

    async def _publish_stats(self, force: bool = False) -> None:
        """Load figures for /metrics, at most every STATS_INTERVAL_S while busy."""
        now = time.monotonic()
        if self.control is None or (not force and now - self._stats_at < STATS_INTERVAL_S):
            return
        self._stats_at = now
        s = self.scheduler
        assert s is not None
        await self.control.send(
            Stats(
                running=len(s.running),
                waiting=len(s.waiting),
                kv_used_pages=s.pool.num_pages - s.pool.num_free,
                kv_total_pages=s.pool.num_pages,
                cached_pages=s.cache.tree.cached_pages,
                retractions=s.retracted,
            )
        )

    async def _emit(self, outputs: Outputs) -> None:
        for worker, errors in outputs.errors.items():
            for error in errors:
                await self.tokenizers[worker].send(error)
        for worker, batch in outputs.batches.items():
            await self.tokenizers[worker].send(batch)
