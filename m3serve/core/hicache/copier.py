"""Page copies between the device KV cache and the host pool: backups (device -> host) and
load-backs (host -> device), pool tensor by pool tensor.

Both run on the executor thread, in order with the steps. A backup is one job queued behind the
steps submitted so far (they may still be writing the pages' KV). A load-back runs inside the
forward of the step that carries it, layer by layer: the model calls `LayerLoad.before_layer(L)`
at the top of layer L, which on CPU copies layer L's pages right then. `cuda_copier.py` issues
every layer at once on a side stream instead, and `before_layer` only makes the compute stream
wait for layer L's event.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from m3serve.core.hicache.host_pool import HostKVPool
from m3serve.core.hicache.tickets import FINISHED, Completion, Ticket


class LayerLoad:
    """The load-backs of one step, run layer by layer as the forward reaches each layer."""

    def __init__(self, copier: Copier, tickets: Sequence[Ticket]) -> None:
        self.copier = copier
        self.tickets = list(tickets)
        self.device = [page for t in self.tickets for page in t.device]
        self.host = [page for t in self.tickets for page in t.host]
        self._pending = sorted(copier.by_layer)  # layers not copied yet

    def before_layer(self, layer: int) -> None:
        # Layers run in order; a forward over a subset (the warm-up) still copies every layer
        # below the one it reaches, so nothing is skipped.
        while self._pending and self._pending[0] <= layer:
            self.copier.load_layer(self._pending.pop(0), self.device, self.host)

    def wait_all(self) -> None:
        """Every layer's pages are there (a forward that has no per-layer hook, a graph replay)."""
        if self._pending:
            self.before_layer(self._pending[-1])

    def finish(self) -> None:
        """Settle the tickets once every copy is issued (also after a failed forward)."""
        self.wait_all()
        for ticket in self.tickets:
            ticket.settle(FINISHED)


class Copier:
    """Synchronous copies with torch indexing (CPU, or any device without a side stream)."""

    def __init__(self, pool: HostKVPool, device_tensors: Sequence[torch.Tensor]) -> None:
        layout = pool.layout
        if len(device_tensors) != len(layout.tensors):
            raise ValueError(f"{len(device_tensors)} device tensors for {len(layout.tensors)}")
        self.pool = pool
        # [slots, *shape] -> [pages, page_size, *shape]: one index per page on both tiers.
        self.device_pages = [t.view(-1, layout.page_size, *t.shape[1:]) for t in device_tensors]
        for spec, view in zip(layout.tensors, self.device_pages, strict=True):
            if tuple(view.shape[2:]) != spec.shape or view.dtype != spec.dtype:
                raise ValueError(f"device tensor {tuple(view.shape)} {view.dtype} vs {spec}")
        self.by_layer: dict[int, list[int]] = {}
        for i, spec in enumerate(layout.tensors):
            self.by_layer.setdefault(spec.layer, []).append(i)

    def backup(self, ticket: Ticket) -> Completion:
        """Copy the ticket's device pages to its host pages, every pool tensor."""
        device, host = self._index(ticket.device), self._index(ticket.host)
        for i, pages in enumerate(self.device_pages):
            self.pool.views[i][host] = pages[device].to("cpu")
        return FINISHED

    def start_load(self, tickets: Sequence[Ticket]) -> LayerLoad:
        return LayerLoad(self, tickets)

    def order_after(self, copy: Completion) -> None:
        """Work issued from now on starts after `copy` (here copies are synchronous)."""

    def load_layer(self, layer: int, device: list[int], host: list[int]) -> None:
        into, src = self._index(device), self._index(host)
        for i in self.by_layer[layer]:
            target = self.device_pages[i]
            target[into.to(target.device)] = self.pool.views[i][src].to(target.device)

    def close(self) -> None:
        """Drop every reference to the pool's memory."""
        self.device_pages = []

    @staticmethod
    def _index(pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int64)


def make_copier(pool: HostKVPool, device_tensors: Sequence[torch.Tensor]) -> Copier:
    """The copier for the device the KV cache lives on."""
    if device_tensors and device_tensors[0].is_cuda:
        from m3serve.core.hicache.cuda_copier import CudaCopier

        return CudaCopier(pool, device_tensors)
    return Copier(pool, device_tensors)
