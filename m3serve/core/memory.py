"""How much the engine core allocates at start: the KV cache's dtype and page count, and the
CPU threads the forward may use."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from m3serve.model.build import DTYPES
from m3serve.model.config import TextConfig
from m3serve.model.kv_cache import KVCache

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_TOKENS = 65536


@dataclass(frozen=True)
class KVBudget:
    num_pages: int
    page_size: int

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size


def kv_cache_dtype(setting: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for `--kv-cache-dtype`; auto is the compute dtype."""
    if setting == "auto":
        return compute_dtype
    if setting == "fp8_e4m3":
        return torch.float8_e4m3fn  # scale 1.0: written saturated, read by casting
    return DTYPES[setting]


def plan_kv_budget(
    cfg: TextConfig,
    device: torch.device,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    kv_dtype: torch.dtype,
    max_useful_tokens: int | None = None,
    kv_heads: int | None = None,
    extra_page_bytes: int = 0,
) -> KVBudget:
    """How many KV pages to allocate: an explicit token count, else what fits on the device,
    but never more than `max_useful_tokens` (every running request at full context).
    `kv_heads`: the KV heads this rank caches (tensor parallelism; default all);
    `extra_page_bytes`: what else each page costs (the speculative draft's KV)."""
    page = cfg.page_size
    if max_total_tokens is not None:
        return KVBudget(-(-max_total_tokens // page), page)
    if device.type != "cuda":
        return KVBudget(DEFAULT_CPU_KV_TOKENS // page, page)
    free, total = torch.cuda.mem_get_info(device)
    # Weights are already resident; the KV pool takes what the static fraction leaves.
    budget = free - total * (1.0 - mem_fraction_static)
    pages = int(budget // (KVCache.bytes_per_page(cfg, kv_dtype, kv_heads) + extra_page_bytes))
    if max_useful_tokens is not None:
        # A small model on a big GPU would otherwise get a pool of tens of millions of pages.
        pages = min(pages, -(-max_useful_tokens // page))
    if pages < 2:
        raise RuntimeError(
            f"no memory left for the KV cache ({free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB); raise --mem-fraction-static or set --max-total-tokens"
        )
    return KVBudget(pages, page)


def leave_a_core_for_the_scheduler(ranks: int = 1) -> None:
    """On CPU the executor thread's intra-op workers and the scheduler's event loop share the
    cores; oversubscribed, every torch op slows several-fold (measured 3.5x on 2 cores). The
    `ranks` engine processes of a tensor-parallel engine share what is left."""
    threads = max(1, ((os.cpu_count() or 2) - 1) // ranks)
    if torch.get_num_threads() > threads:
        log.info("CPU executor: torch intra-op threads %d -> %d", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)
