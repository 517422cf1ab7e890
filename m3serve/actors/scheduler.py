"""SchedulerActor: the engine process's message I/O around its `EngineCore`.

Requests and aborts are received by their own task, so they land between steps; the step loop
runs the core's `overlap_step` (or `step` with --disable-overlap-schedule), sends each
step's tokens to the tokenizer workers that own the requests and writes the engine's load
figures to its `EngineMetrics`.

With --enable-hierarchical-cache it also holds the engine's `StorageClient` of the host-cache
actor (`hicache`): the core gets it with this actor's event loop (`ActorLink`), asks it for the
host pool as it starts, and runs the L3 tier through it. At stop the last L3 writes are sent
before the client closes.

With --tp N this is rank 0's process: `rank` says where the core joins its rank group, and the
follower ranks (engine/ranks.py) run the plans this actor's core makes.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from pathlib import Path
from typing import Any

from m3serve.actors.engine_metrics import EngineMetrics
from m3serve.core.engine_core import EngineCore
from m3serve.core.hicache.storage_client import StorageClient
from m3serve.core.hicache.storage_tier import ActorLink
from m3serve.core.media import read_media
from m3serve.core.req import Req
from m3serve.core.scheduler import Outputs, QueueFull
from m3serve.runtime.actor import Actor, handles
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import Abort, Error, RankAddress, Shutdown, Tokenized
from m3serve.runtime.shm import unpack_token_ids
from m3serve.runtime.transport import Inbox, Outbox

log = logging.getLogger(__name__)

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
        hicache: StorageClient | None = None,
        rank: RankAddress | None = None,
    ) -> None:
        super().__init__(inbox, control)
        self.hicache = hicache
        self.rank = rank
        self.tokenizers = tokenizers
        self.args = args
        self.model_path = model_path
        self.core: EngineCore | None = None
        self._wake = asyncio.Event()
        self.metrics = EngineMetrics()

    async def on_start(self) -> dict[str, Any]:
        link = None
        if self.hicache is not None:
            loop = asyncio.get_running_loop()
            link = ActorLink(self.hicache, loop, self.args.runtime.startup_timeout)
        self.core = await asyncio.to_thread(EngineCore, self.args, self.model_path, link, self.rank)
        return self.core.info()

    async def on_stop(self) -> None:
        if self.core is not None:
            await self.core.flush_storage()
        if self.hicache is not None:
            await self.hicache.close()
        if self.core is not None:
            self.core.close()
            self.core = None

    # ------------------------------------------------------------------ messages

    @handles(Tokenized)
    async def on_tokenized(self, msg: Tokenized) -> None:
        assert self.core is not None
        try:
            media = read_media(msg.media)  # unlinks every segment, even when one is unreadable
        except ValueError as exc:
            await self.tokenizers[msg.worker].send(Error(msg.rid, str(exc), 400))
            return
        req = Req(
            rid=msg.rid,
            prompt=unpack_token_ids(msg.input_ids).tolist(),
            sampling=msg.sampling,
            stop_ids=frozenset(msg.stop_token_ids),
            worker=msg.worker,
            max_new=msg.max_new_tokens,
            media=media,
        )
        try:
            self.core.add(req, fit_to_pool=msg.fit_to_pool)
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
        assert self.core is not None
        self.core.abort(msg.rid)

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
        core = self.core
        assert core is not None
        overlap = not self.args.sched.disable_overlap_schedule
        receiver = asyncio.create_task(self._receive(), name="scheduler-receive")
        # Overlap: a step's outputs, sent once the step after next is launched (`overlap_step`).
        unsent: Outputs | None = None
        try:
            while not self.stopping:
                if receiver.done():
                    receiver.result()  # a crashed receiver is a crashed actor
                # Cleared before planning: a message that lands from here on wakes the idle wait.
                self._wake.clear()
                if overlap:
                    outputs = unsent = await core.overlap_step(partial(self._emit, unsent))
                else:
                    outputs = await core.step()
                    await self._emit(outputs)
                # Cheap per step: unchanged figures write nothing, changed ones a few floats
                # (mmap writes when the actors run as processes).
                self.metrics.update(core.scheduler, core.compiles_after_ready)
                if outputs is None:
                    await self._idle(receiver)
            await self._emit(unsent)  # None without overlap: each step's went out as it ended
            await self._emit(await core.drain())
        finally:
            receiver.cancel()

    async def _idle(self, receiver: asyncio.Task[None]) -> None:
        """Sleep until a message arrives (or the receiver dies); re-plan periodically if work
        is queued but could not be scheduled yet."""
        assert self.core is not None
        timeout = IDLE_RECHECK_S if self.core.has_work else None
        woken = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait({woken, receiver}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()

    async def _emit(self, outputs: Outputs | None) -> None:
        if outputs is None:
            return
        for worker, errors in outputs.errors.items():
            for error in errors:
                await self.tokenizers[worker].send(error)
        for worker, batch in outputs.batches.items():
            await self.tokenizers[worker].send(batch)
