"""`HostTier`: what the engine core holds for HiCache — the host KV pool, the copier between it
and the device KV cache, and the copy tracker it shares with the tiered prefix cache.

The host pool is the host-cache actor's (actors/hicache/): `create` sizes it and has `open_pool`
(storage_tier.py's `ActorLink`) ask the actor for it and attach the segment. With speculative
decoding the draft's KV pool (page-aligned with the target's) is part of every host page, so a
prefix comes back from the host or L3 with the draft KV its tokens had.

The prefix cache (scheduler side) makes tickets; this object runs them on the executor thread:
a backup as a job queued behind the steps submitted so far (`submit_backup`), a step's load-backs
inside its forward (`start_loads`, whose `before_layer` the model calls at each layer). Once the
actor died (`disable`), queued backups no longer copy: their tickets just settle.

Tensor parallelism: every rank holds a host pool of its own KV slice, page for page like rank
0's (the ranks agree on the page count); the actor makes them all in one segment, whose name
rank 0 hands to the followers (`rank_pool_opener`). Load-backs travel in the step plans, which
every rank runs; a backup is rank 0's own job, so `mirror` hands each one to the followers as a
plan of its own, sent from that job on the executor thread — in order with the steps, as on
rank 0 — and a follower runs it on its slices (`mirror_backups`) before the steps after it.
With L3 storage the actor reads every rank's piece of a page once its backup is done, so there
a backup ends in a `barrier`: each rank waits for its own copy, then for the others.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from m3serve.core.hicache.copier import Copier, LayerLoad, make_copier
from m3serve.core.hicache.host_pool import (
    HostKVPool,
    PageLayout,
    PoolTensor,
    draft_tensors,
    model_layout,
)
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.sizing import plan_host_pages
from m3serve.core.hicache.tickets import FINISHED, Completion, CopyTracker, Ticket
from m3serve.core.ranks import LEADER, host_barrier, share_text
from m3serve.model.config import TextConfig
from m3serve.model.dspark_paged import DraftKV
from m3serve.model.kv_cache import KVCache
from m3serve.model.parallel import RankGroup
from m3serve.runtime.config import HiCacheArgs
from m3serve.runtime.messages import PageCopy, StepPlan

log = logging.getLogger(__name__)

# Runs a job on the executor thread after everything submitted before it (Executor.call).
CallOnExecutor = Callable[[Callable[[], Any], str], "concurrent.futures.Future[Any]"]
# This rank's host pool of this layout and page count, attached (`rank_pool_opener`).
OpenPool = Callable[[PageLayout, int], HostKVPool]
# The page count every rank of a tensor-parallel engine can hold, from this rank's plan.
Agree = Callable[[int], int]
# Opens the pool of every rank of a tensor-parallel engine (ActorLink.open_pool).
OpenRankPools = Callable[[PageLayout, int, int], HostKVPool]


def rank_pool_opener(ranks: RankGroup, open_pools: OpenRankPools | None) -> OpenPool:
    """How this rank gets its host pool: rank 0 has the host-cache actor make every rank's (in
    one segment) and shares the segment's name; a follower attaches its own part of it."""
    if ranks.rank == LEADER:
        if open_pools is None:
            raise ValueError(
                "--enable-hierarchical-cache needs the host-cache actor, which owns the "
                "host pool: start the engine through the actor graph (engine/launch.py)"
            )
        opener = open_pools

        def open_leader(layout: PageLayout, num_pages: int) -> HostKVPool:
            pool = opener(layout, num_pages, ranks.size)
            if ranks.size > 1:
                share_text(ranks, pool.segment_name)
            return pool

        return open_leader

    def attach(layout: PageLayout, num_pages: int) -> HostKVPool:
        name = share_text(ranks, None)
        return HostKVPool.attach(name, layout, num_pages, rank=ranks.rank)

    return attach


class HostTier:
    def __init__(
        self, args: HiCacheArgs, pool: HostKVPool, copier: Copier, call: CallOnExecutor
    ) -> None:
        self.args = args
        self.pool = pool
        self.copier = copier
        self._call = call
        self.copies = CopyTracker(submit=self.submit_backup)
        self.enabled = True  # False once the pool's owner died: no new copies to the segment
        # Rank 0 of several: hands each backup it runs to the follower ranks.
        self.mirror: Callable[[PageCopy], None] | None = None
        # Ranks 1..N-1: no scheduler, so no tickets of their own; a plan's copies make them.
        self.follower = False
        # With several ranks and L3: every rank has its copy of a backup done past this.
        self.barrier: Callable[[], None] | None = None

    @classmethod
    def create(
        cls,
        args: HiCacheArgs,
        cfg: TextConfig,
        kv: KVCache,
        device_pages: int,
        open_pool: OpenPool,
        call: CallOnExecutor,
        draft: DraftKV | None = None,
        ranks_on_host: int = 1,
        agree: Agree | None = None,
    ) -> HostTier:
        """Size the host pool against free host memory, have it opened, pin it on CUDA.
        `draft`: the speculative draft's KV pool, which every host page then holds too;
        `ranks_on_host`: the tensor-parallel ranks sharing this host's memory, and `agree`
        their common page count."""
        layout = host_layout(cfg, kv, draft)
        host_pages = plan_host_pages(args, device_pages, layout.page_bytes, ranks_on_host)
        if agree is not None:
            host_pages = agree(host_pages)
        pool = open_pool(layout, host_pages)
        try:
            copier = make_copier(pool, device_tensors(kv, layout, draft))
        except BaseException:
            pool.close()
            raise
        log.info(
            "HiCache host pool: %d pages x %d bytes (%.2f GiB, %.2fx the device pool%s), %s",
            host_pages,
            layout.page_bytes,
            pool.nbytes / 2**30,
            host_pages / max(device_pages, 1),
            ", with the draft KV" if draft is not None else "",
            args.hicache_write_policy,
        )
        return cls(args, pool, copier, call)

    def prefix_cache(self, num_pages: int, page_size: int) -> HiPrefixCache:
        """The scheduler's tiered prefix cache over `num_pages` device pages and this pool."""
        policy = self.args.hicache_write_policy
        return HiPrefixCache(num_pages, self.pool.num_pages, page_size, policy, self.copies)

    # ------------------------------------------------------------------ copies

    def submit_backup(self, ticket: Ticket) -> None:
        def backup() -> None:
            if not self.enabled:
                ticket.settle()  # the host tier is gone: nothing reads this copy any more
                return
            try:
                if self.mirror is not None:
                    self.mirror(PageCopy(ticket.op, ticket.device, ticket.host))
                ticket.settle(self._copied_everywhere(self.copier.backup(ticket)))
            except BaseException:
                ticket.settle()  # nobody may wait forever on it; the error is logged
                raise

        self._call(backup, f"HiCache backup {ticket.op}")

    def start_loads(self, plan: StepPlan) -> LayerLoad | None:
        """The step's load-backs, ready to run layer by layer (executor thread)."""
        if not plan.loads:
            return None
        if self.follower:
            tickets = [Ticket(copy.op, "load", copy.device, copy.host) for copy in plan.loads]
        else:
            tickets = [self.copies.get(copy.op) for copy in plan.loads]
        return self.copier.start_load(tickets)

    def spread_over(self, ranks: RankGroup, mirror: Callable[[PageCopy], None], l3: bool) -> None:
        """A tier of one rank of several: rank 0 hands each backup to the followers (`mirror`),
        a follower takes its copies from the plans; with L3 (`l3`), the actor stores every
        rank's piece of a page once its backup is done, so a backup ends in a barrier."""
        if ranks.rank == LEADER:
            self.mirror = mirror
        else:
            self.follower = True
        if l3:
            self.barrier = lambda: host_barrier(ranks)

    def mirror_backups(self, copies: list[PageCopy]) -> None:
        """A follower rank: rank 0's backups, on this rank's KV slices. Rank 0 frees a backed-up
        device page only once its own copy is done; here the steps after wait for the copy on
        the device instead (`Copier.order_after`), so none of them overwrites a page first."""
        for copy in copies:
            ticket = Ticket(copy.op, "backup", copy.device, copy.host)
            self.copier.order_after(self._copied_everywhere(self.copier.backup(ticket)))

    def _copied_everywhere(self, copy: Completion) -> Completion:
        """With a `barrier` (several ranks and L3): once this rank's copy is done and every
        rank's is, the copy, done; else the copy as issued."""
        if self.barrier is None:
            return copy
        copy.wait()
        self.barrier()
        return FINISHED

    def disable(self) -> None:
        """The host pool's owner died (scheduler thread): backups not run yet are skipped."""
        self.enabled = False

    def close(self) -> None:
        """After the executor stopped: every copy is finished, the pool unpinned and removed."""
        self.copies.wait_all(issued_only=True)
        self.copier.close()
        self.pool.close()


def host_layout(cfg: TextConfig, kv: KVCache, draft: DraftKV | None = None) -> PageLayout:
    """A host page of this KV cache: the target's pools, then the draft's (if any)."""
    extra = []
    if draft is not None and draft.k:
        k = draft.k[0]
        shape = (k.shape[1], k.shape[2])
        extra = draft_tensors(cfg.num_layers, len(draft.k), shape, k.dtype)
    k = kv.layers[0].k
    return model_layout(cfg, k.dtype, extra, kv_heads=k.shape[1])


def device_tensors(kv: KVCache, layout: PageLayout, draft: DraftKV | None = None) -> list[Any]:
    """The device KV tensor of each pool tensor, in the layout's order."""
    return [_device_tensor(kv, t, draft) for t in layout.tensors]


def _device_tensor(kv: KVCache, t: PoolTensor, draft: DraftKV | None) -> Any:
    if t.name in ("draft_k", "draft_v"):
        if draft is None:
            raise ValueError(f"the host layout has {t.name}{t.layer} but the engine no draft")
        pools = draft.k if t.name == "draft_k" else draft.v
        return pools[t.layer - len(kv.layers)]
    return getattr(kv.layers[t.layer], t.name)
