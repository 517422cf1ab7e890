"""Page copies on a GPU: the host pool pinned (cudaHostRegister) so that copies are async DMA, all
of them on one side stream, ordered after the compute stream's work so far.

Backup: the side stream waits for the compute stream (the steps before may still write the
pages), copies device -> host, records an event: the ticket is done when the event is.
Load-back: the side stream waits for the compute stream (steps before may still read or write
the target pages), then copies layer by layer, one event per layer; the forward's stream waits
for layer L's event at the top of layer L, so layer L computes while later layers still copy.
One side stream for both kinds keeps every copy in issue order.

Copies go page by page (each piece of a host page is contiguous); runs of pages could become one
gather kernel later if launch overhead shows up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from m3serve.core.hicache.copier import Copier, LayerLoad
from m3serve.core.hicache.host_pool import HostKVPool
from m3serve.core.hicache.tickets import Completion, Ticket


class EventDone:
    """A copy issued on a CUDA stream: done when its event is."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class CudaLayerLoad(LayerLoad):
    """Every layer issued up front on the side stream; `before_layer` is a stream wait."""

    def __init__(self, copier: CudaCopier, tickets: Sequence[Ticket]) -> None:
        super().__init__(copier, tickets)
        self.events: dict[int, torch.cuda.Event] = {}
        stream = copier.stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for layer in sorted(copier.by_layer):
                copier.load_layer(layer, self.device, self.host)
                event = torch.cuda.Event()
                event.record(stream)
                self.events[layer] = event
        self._pending = []

    def before_layer(self, layer: int) -> None:
        event = self.events.get(layer)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait_all(self) -> None:
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[max(self.events)])

    def finish(self) -> None:
        last = self.events[max(self.events)] if self.events else None
        for ticket in self.tickets:
            if last is None:
                ticket.settle()
            else:
                ticket.settle(EventDone(last))


class CudaCopier(Copier):
    def __init__(self, pool: HostKVPool, device_tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(pool, device_tensors)
        device = device_tensors[0].device
        self.stream = torch.cuda.Stream(device)
        self._pinned = pool.raw.data_ptr()
        code = torch.cuda.cudart().cudaHostRegister(self._pinned, pool.nbytes, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of the host KV pool failed (error {int(code)})")

    def backup(self, ticket: Ticket) -> Completion:
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for i, pages in enumerate(self.device_pages):
                host = self.pool.views[i]
                for d, h in zip(ticket.device, ticket.host, strict=True):
                    host[h].copy_(pages[d], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return EventDone(event)

    def start_load(self, tickets: Sequence[Ticket]) -> LayerLoad:
        return CudaLayerLoad(self, tickets)

    def order_after(self, copy: Completion) -> None:
        """The compute stream waits for `copy` on the device (the host does not)."""
        if isinstance(copy, EventDone):
            torch.cuda.current_stream(self.stream.device).wait_event(copy.event)

    def load_layer(self, layer: int, device: list[int], host: list[int]) -> None:
        # Called inside `torch.cuda.stream(self.stream)` by CudaLayerLoad.
        for i in self.by_layer[layer]:
            pages, src = self.device_pages[i], self.pool.views[i]
            for d, h in zip(device, host, strict=True):
                pages[d].copy_(src[h], non_blocking=True)

    def close(self) -> None:
        """Wait for every copy, then unpin: the kernel's own cleanup of a large pinned region
        at exit can stall for many seconds."""
        self.stream.synchronize()
        torch.cuda.cudart().cudaHostUnregister(self._pinned)
        super().close()
