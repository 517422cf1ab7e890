"""One CUDA graph per batch-size bucket over static input buffers: the capture and replay that
the draft proposal (draft_graphs.py) and the verify forward (verify_graphs.py) share.

`make_inputs(bs)` builds a bucket's static inputs, already valid padding (the caller loads a
step's rows over the first ones before each replay); `forward(inputs)` must run device ops
only — no host sync, no data-dependent shape — and returns the bucket's outputs, which the
graph rewrites on every replay. Buckets are captured largest first, sharing one memory pool
(which may be another graph set's), each after an eager run that compiles and autotunes its
kernels outside the capture.

Without CUDA (`capture=False`, tests) `replay` runs `forward` eagerly over the same static
buffers, so the loading and padding are checked on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class _Bucket(Generic[In, Out]):
    inputs: In
    outputs: Out | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphSet(Generic[In, Out]):
    def __init__(
        self,
        sizes: Sequence[int],
        make_inputs: Callable[[int], In],
        forward: Callable[[In], Out],
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.sizes = sorted(sizes)
        self.forward = forward
        self.device = device
        self.captured = capture
        self.buckets = {bs: _Bucket[In, Out](make_inputs(bs)) for bs in self.sizes}

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds `rows` (≤ max_bs)."""
        return next(size for size in self.sizes if size >= rows)

    def inputs(self, bs: int) -> In:
        return self.buckets[bs].inputs

    def capture(self, pool: object | None = None) -> object | None:
        """Capture every bucket into `pool` (another graph set's, to share its memory: graphs
        replayed one after another never need their intermediates at once); the pool used."""
        if not self.captured:
            return pool
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for bs in reversed(self.sizes):
                bucket = self.buckets[bs]
                self.forward(bucket.inputs)  # compile and autotune outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    bucket.outputs = self.forward(bucket.inputs)
                pool = graph.pool()
                bucket.graph = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return pool

    def replay(self, bs: int) -> Out:
        """The outputs of bucket `bs` over what its static inputs hold now."""
        bucket = self.buckets[bs]
        if bucket.graph is None:
            with torch.inference_mode():
                return self.forward(bucket.inputs)
        bucket.graph.replay()
        assert bucket.outputs is not None
        return bucket.outputs
