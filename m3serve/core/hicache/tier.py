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
from m3serve.core.hicache.tickets import CopyTracker, Ticket
from m3serve.model.config import TextConfig
from m3serve.model.dspark_paged import DraftKV
from m3serve.model.kv_cache import KVCache
from m3serve.runtime.config import HiCacheArgs
from m3serve.runtime.messages import StepPlan

log = logging.getLogger(__name__)

# Runs a job on the executor thread after everything submitted before it (Executor.call).
CallOnExecutor = Callable[[Callable[[], Any], str], "concurrent.futures.Future[Any]"]
# The host pool of this layout and page count, attached (ActorLink.open_pool).
OpenPool = Callable[[PageLayout, int], HostKVPool]


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
    ) -> HostTier:
        """Size the host pool against free host memory, have it opened, pin it on CUDA.
        `draft`: the speculative draft's KV pool, which every host page then holds too."""
        layout = host_layout(cfg, kv, draft)
        host_pages = plan_host_pages(args, device_pages, layout.page_bytes)
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
                ticket.settle(self.copier.backup(ticket))
            except BaseException:
                ticket.settle()  # nobody may wait forever on it; the error is logged
                raise

        self._call(backup, f"HiCache backup {ticket.op}")

    def start_loads(self, plan: StepPlan) -> LayerLoad | None:
        """The step's load-backs, ready to run layer by layer (executor thread)."""
        if not plan.loads:
            return None
        return self.copier.start_load([self.copies.get(copy.op) for copy in plan.loads])

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
    return model_layout(cfg, kv.layers[0].k.dtype, extra)


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
