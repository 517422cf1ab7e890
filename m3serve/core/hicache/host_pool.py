"""The host KV pool: one shared-memory segment holding KV pages evicted from (or copied off) the
device, page-major.

Byte layout, self-contained so that another process (the HiCache actor's L3 file tier) can treat
a page as an opaque blob: host page h is the byte range [h * page_bytes, (h + 1) * page_bytes).
Inside a page, the pool tensors of `PageLayout.tensors` follow each other in that order, each
`page_size * prod(shape)` elements of its dtype, each starting at a multiple of ALIGN bytes. The
model's order (`model_layout`) is: for each layer, K [page_size, kv_heads, head_dim], V (same),
then index-K [page_size, index_head_dim] on sparse layers. With a speculative draft, its KV
follows the target's (`draft_tensors`): per draft layer i, draft_k and draft_v [page_size,
kv_heads, head_dim], numbered as layer num_layers + i, so a layer-by-layer load-back copies the
draft's pages after every target layer (the draft first reads them at the next verify step).
Without a draft the layout is the target's alone, byte for byte.

`HostKVPool.create` makes the segment (in the product path the HiCache actor does, and the engine
`attach`es to it by name); torch views over it give, per pool tensor, [num_pages, page_size,
*shape]. Which host pages are free is the tiered prefix cache's business (a `PagePool`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch

from m3serve.model.config import TextConfig
from m3serve.runtime.shm import attach_segment, create_segment, unlink_segment

ALIGN = 64  # bytes; every pool tensor's piece of a page starts on a cache line


@dataclass(frozen=True)
class PoolTensor:
    """One per-layer KV tensor as the pool stores it: per token, `shape` elements of `dtype`."""

    name: str  # the device layer's KV attribute (k, v, index_k), or draft_k / draft_v
    layer: int  # the target's layer, or num_layers + i for the draft's layer i
    shape: tuple[int, ...]
    dtype: torch.dtype

    def page_nbytes(self, page_size: int) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return page_size * math.prod(self.shape) * item


@dataclass(frozen=True)
class PageLayout:
    """Where each pool tensor's piece of a host page lies, in bytes from the page's start."""

    tensors: tuple[PoolTensor, ...]
    page_size: int
    offsets: tuple[int, ...]
    page_bytes: int

    @classmethod
    def of(cls, tensors: list[PoolTensor], page_size: int) -> PageLayout:
        offsets, at = [], 0
        for tensor in tensors:
            offsets.append(at)
            at = _aligned(at + tensor.page_nbytes(page_size))
        return cls(tuple(tensors), page_size, tuple(offsets), max(at, ALIGN))

    def describe(self) -> str:
        """Where every byte of a page comes from, as text: part of the L3 keys' root, so that
        stores written under another layout are never read as this one."""
        parts = [
            f"{t.name}{t.layer}:{'x'.join(map(str, t.shape))}:{t.dtype}@{offset}"
            for t, offset in zip(self.tensors, self.offsets, strict=True)
        ]
        return f"{self.page_size}/{self.page_bytes}/" + ",".join(parts)


def model_layout(
    cfg: TextConfig,
    dtype: torch.dtype,
    extra: Sequence[PoolTensor] = (),
    kv_heads: int | None = None,
) -> PageLayout:
    """The target model's KV pools in a host page: per layer K, V and (sparse layers) index-K;
    then `extra` (the draft's, `draft_tensors`). `kv_heads`: the KV heads this rank caches
    (tensor parallelism: each rank's host pool holds its own slice); default all."""
    kv = (kv_heads or cfg.num_kv_heads, cfg.head_dim)
    tensors = []
    for layer in range(cfg.num_layers):
        tensors.append(PoolTensor("k", layer, kv, dtype))
        tensors.append(PoolTensor("v", layer, kv, dtype))
        if cfg.is_sparse(layer):
            tensors.append(PoolTensor("index_k", layer, (cfg.index_head_dim,), dtype))
    return PageLayout.of([*tensors, *extra], cfg.page_size)


def draft_tensors(
    num_target_layers: int, num_layers: int, kv: tuple[int, int], dtype: torch.dtype
) -> list[PoolTensor]:
    """A draft's KV pools: draft_k and draft_v [kv_heads, head_dim] per token for each of its
    `num_layers` layers, numbered after the target's `num_target_layers`."""
    tensors = []
    for i in range(num_layers):
        tensors.append(PoolTensor("draft_k", num_target_layers + i, kv, dtype))
        tensors.append(PoolTensor("draft_v", num_target_layers + i, kv, dtype))
    return tensors


class HostKVPool:
    """`num_pages` host pages in one shared-memory segment, and a torch view per pool tensor.
    `rank`: which of the segment's per-rank pools this is (tensor parallelism: rank r's pages
    start at byte r * num_pages * page_bytes)."""

    def __init__(
        self, layout: PageLayout, num_pages: int, shm: SharedMemory, owner: bool, rank: int = 0
    ) -> None:
        start = rank * num_pages * layout.page_bytes
        if shm.size < start + num_pages * layout.page_bytes:
            of = f" of rank {rank}" if rank else ""
            raise ValueError(
                f"segment {shm.name} holds {shm.size} bytes, {num_pages} pages{of} need "
                f"{start + num_pages * layout.page_bytes}"
            )
        self.layout = layout
        self.num_pages = num_pages
        self._shm: SharedMemory | None = shm
        self._owner = owner
        count = num_pages * layout.page_bytes
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=count, offset=start)
        self.raw = flat.view(num_pages, layout.page_bytes)  # page h = raw[h], an opaque blob
        self.views = [
            self._view(tensor, offset)
            for tensor, offset in zip(layout.tensors, layout.offsets, strict=True)
        ]

    @classmethod
    def create(cls, session: str, layout: PageLayout, num_pages: int) -> HostKVPool:
        """A new, zeroed segment of the session; `close` removes it."""
        shm = create_segment(session, num_pages * layout.page_bytes)
        try:
            return cls(layout, num_pages, shm, owner=True)
        except BaseException:
            unlink_segment(shm)
            raise

    @classmethod
    def attach(cls, name: str, layout: PageLayout, num_pages: int, rank: int = 0) -> HostKVPool:
        """Another process's segment (`segment_name` there), the pool of `rank` in it; `close`
        leaves it in place."""
        shm = attach_segment(name)
        try:
            return cls(layout, num_pages, shm, owner=False, rank=rank)
        except BaseException:
            shm.close()
            raise

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def segment_name(self) -> str:
        assert self._shm is not None, "the pool is closed"
        return self._shm.name

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    def close(self) -> None:
        """Drop the views, then close (and, as creator, remove) the segment."""
        if self._shm is None:
            return
        # The segment cannot close while a tensor still exports its buffer.
        del self.raw, self.views
        shm, self._shm = self._shm, None
        if self._owner:
            unlink_segment(shm)
        else:
            shm.close()

    def _view(self, tensor: PoolTensor, offset: int) -> torch.Tensor:
        """[num_pages, page_size, *shape] over the bytes of this tensor in every page."""
        nbytes = tensor.page_nbytes(self.layout.page_size)
        piece = self.raw[:, offset : offset + nbytes].view(tensor.dtype)
        return piece.view(self.num_pages, self.layout.page_size, *tensor.shape)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
