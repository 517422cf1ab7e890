"""Small host arrays (a step's token ids, positions, page changes, sampling knobs) onto the
device without waiting for the kernels already queued there, and a step's sampled tokens back
(`Download`) without waiting for the kernels queued after them.

A plain `.to(cuda)` from pageable memory synchronizes with the stream, so every kernel queued
before it must finish first. A copy from pinned memory is queued behind them instead. Pinning a
fresh block per array cost ~50 µs of host time each on the H200 (a served decode step made ~15:
18 % of the executor thread), so the arrays pass through one pinned staging buffer per device,
and `upload_many` sends a step's several arrays in a single copy. `Packed` keeps a CUDA graph's
static input arrays in one allocation, refilled the same way, in one copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

Values = np.ndarray | Sequence[int] | Sequence[float] | Sequence[Sequence[float]]

# Each array starts on a 64-byte boundary of the staging buffer and of the device copy, so every
# view meets any kernel's alignment needs.
_ALIGN = 64
_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
}


def upload(values: Values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host array as a tensor on `device`, queued behind the device's work."""
    return upload_many([(values, dtype)], device)[0]


def upload_many(
    items: Sequence[tuple[Values, torch.dtype]], device: torch.device | str
) -> list[torch.Tensor]:
    """Several small host arrays as tensors on `device` (views of one allocation), sent in one
    host-to-device copy that waits for nothing queued before it."""
    device = torch.device(device)
    if device.type != "cuda" or any(dtype not in _NUMPY for _, dtype in items):
        return [torch.as_tensor(np.asarray(v), dtype=dtype).to(device) for v, dtype in items]
    arrays = [np.asarray(v, dtype=_NUMPY[dtype]) for v, dtype in items]
    arrays = [a if a.flags.c_contiguous else a.copy() for a in arrays]
    return _staging(device).send(arrays, [dtype for _, dtype in items])


class Packed:
    """Fixed-size arrays (a CUDA graph's static inputs) as views of one device allocation, each
    at a 64-byte boundary, so that `fill` writes them all in a single host-to-device copy."""

    def __init__(self, specs: Sequence[tuple[int, torch.dtype]], device: torch.device) -> None:
        """`specs`: each array's length and dtype."""
        self.offsets, total = [], 0
        for length, dtype in specs:
            self.offsets.append(total)
            total += _aligned(length * dtype.itemsize)
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        self.dtypes = [dtype for _, dtype in specs]
        self.views = [
            self.buffer[at : at + length * dtype.itemsize].view(dtype)
            for at, (length, dtype) in zip(self.offsets, specs, strict=True)
        ]

    def fill(self, values: Sequence[Values], first: int = 0) -> None:
        """The values of the arrays from the `first` on (each its array's length), in one copy
        queued on the current stream behind the work before it."""
        views = self.views[first:]
        if len(values) != len(views):
            raise ValueError(f"{len(values)} arrays for {len(views)} views")
        arrays = []
        for v, view, dtype in zip(values, views, self.dtypes[first:], strict=True):
            array = np.ascontiguousarray(v, dtype=_NUMPY[dtype])
            if array.shape != (view.numel(),):
                raise ValueError(f"an array of shape {array.shape} for a view of {view.numel()}")
            arrays.append(array)
        if self.buffer.device.type != "cuda":
            for array, view in zip(arrays, views, strict=True):
                view.copy_(torch.from_numpy(array))
            return
        at = self.offsets[first]
        offsets = [offset - at for offset in self.offsets[first:]]
        _staging(self.buffer.device).send_into(self.buffer[at:], offsets, arrays)


_STAGING: dict[torch.device, _Staging] = {}
_RETURNS: dict[torch.device, _Returns] = {}
_TABLES_LOCK = threading.Lock()
T = TypeVar("T")


def _staging(device: torch.device) -> _Staging:
    return _per_device(_STAGING, device, _Staging)


def _returns(device: torch.device) -> _Returns:
    return _per_device(_RETURNS, device, lambda _: _Returns())


def _per_device(table: dict[torch.device, T], device: torch.device, make: Callable[..., T]) -> T:
    """`table`'s entry for a CUDA device (the current one for a bare "cuda"), made on first use."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _TABLES_LOCK:
        entry = table.get(device)
        if entry is None:
            entry = table[device] = make(device)
        return entry


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Staging:
    """A pinned buffer in `chunks` equal parts, filled front to back. Leaving a part records an
    event on each stream that copied from it; a part is written again only after its events,
    so a copy still queued on the device never reads bytes that were overwritten."""

    def __init__(self, device: torch.device, chunk_bytes: int = 1 << 18, chunks: int = 8) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.buffer = torch.empty(chunk_bytes * chunks, dtype=torch.uint8, pin_memory=True)
        self.host = self.buffer.numpy()
        self.fences: list[list[torch.cuda.Event]] = [[] for _ in range(chunks)]
        self.streams: set[torch.cuda.Stream] = set()  # streams that copied from the current part
        self.chunk = 0
        self.used = 0
        self.lock = threading.Lock()

    def send(self, arrays: list[np.ndarray], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += _aligned(array.nbytes)
        if total > self.chunk_bytes or torch.cuda.is_current_stream_capturing():
            # Too big for a part, or a graph capture (which would keep reading this address).
            return [
                torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True) for a in arrays
            ]
        with self.lock:
            if self.used + total > self.chunk_bytes:
                self._next_chunk()
            start = self.chunk * self.chunk_bytes + self.used
            for array, offset in zip(arrays, offsets, strict=True):
                at = start + offset
                self.host[at : at + array.nbytes] = array.reshape(-1).view(np.uint8)
            self.used += total
            stream = torch.cuda.current_stream(self.device)
            self.streams.add(stream)
            sent = self.buffer[start : start + total].to(self.device, non_blocking=True)
        return [
            sent[offset : offset + array.nbytes].view(dtype).view(array.shape)
            for array, offset, dtype in zip(arrays, offsets, dtypes, strict=True)
        ]

    def send_into(self, dest: torch.Tensor, offsets: list[int], arrays: list[np.ndarray]) -> None:
        """`arrays` into `dest` (uint8, on the device) at `offsets`, in one copy of the span
        they cover (the bytes between them are copied too: `dest`'s padding)."""
        total = offsets[-1] + arrays[-1].nbytes
        if torch.cuda.is_current_stream_capturing():
            # A captured copy would read this staging address again at every replay.
            raise RuntimeError("static arrays are filled outside a CUDA graph capture")
        if total > self.chunk_bytes:
            raise ValueError(f"{total} bytes do not fit a staging part of {self.chunk_bytes}")
        with self.lock:
            if self.used + _aligned(total) > self.chunk_bytes:
                self._next_chunk()
            start = self.chunk * self.chunk_bytes + self.used
            for array, offset in zip(arrays, offsets, strict=True):
                at = start + offset
                self.host[at : at + array.nbytes] = array.view(np.uint8)
            self.used += _aligned(total)
            self.streams.add(torch.cuda.current_stream(self.device))
            dest[:total].copy_(self.buffer[start : start + total], non_blocking=True)

    def _next_chunk(self) -> None:
        fences = []
        for stream in self.streams:
            event = torch.cuda.Event()
            event.record(stream)
            fences.append(event)
        self.fences[self.chunk] = fences
        self.streams = set()
        self.chunk = (self.chunk + 1) % len(self.fences)
        self.used = 0
        for event in self.fences[self.chunk]:  # queued long ago: almost always done already
            event.synchronize()
        self.fences[self.chunk] = []


class Download:
    """A small device tensor's values on their way to the host, copied behind the work queued
    before it and not behind what is queued after: with a step launched ahead of this one's
    tokens (core/step_runner.py), a plain `.tolist()` would wait for that step too. The copy
    goes through a ring of pinned buffers (`_Returns`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            self._values = tensor.tolist()
            return
        self._shape = tensor.shape
        self._event = torch.cuda.Event()
        self._host = _returns(tensor.device).copy(tensor, self._event)

    def tolist(self) -> list:  # type: ignore[type-arg]
        """The values (as `Tensor.tolist` gives them), once the copy is done."""
        if self._event is not None:
            self._event.synchronize()
            self._values = self._host.view(self._shape).tolist()
            self._event = None
        return self._values


class _Returns:
    """Pinned buffers for `Download`, used in turn: one is written again only after the event
    of its last copy (long done: two steps at most are in flight)."""

    def __init__(self, buffers: int = 4) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * buffers
        self.fences: list[torch.cuda.Event | None] = [None] * buffers
        self.turn = 0
        self.lock = threading.Lock()

    def copy(self, tensor: torch.Tensor, done: torch.cuda.Event) -> torch.Tensor:
        """`tensor`'s bytes into the next buffer, queued on the current stream; `done` is
        recorded behind the copy. Returns the host view they arrive in."""
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            turn = self.turn
            self.turn = (turn + 1) % len(self.buffers)
            fence, buffer = self.fences[turn], self.buffers[turn]
            if fence is not None:
                fence.synchronize()
            if buffer is None or buffer.numel() < nbytes:
                buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
                self.buffers[turn] = buffer
            host = buffer[:nbytes].view(tensor.dtype)
            host.copy_(tensor.reshape(-1), non_blocking=True)
            done.record()
            self.fences[turn] = done
        return host
