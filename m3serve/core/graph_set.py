"""How the engine captures CUDA graphs, and one graph per batch-size bucket over static input
buffers (`GraphSet`): the capture and replay that the piecewise steps' draw (head_draw.py), the
draft proposal (spec/draft_graphs.py) and the verify forward (spec/verify_graphs.py) share.

Every capture runs on a side stream (`capture_stream`: CUDA refuses one on the legacy default
stream) after an eager run that compiles and autotunes its kernels outside it, and each graph
takes the memory pool of the one captured before it (`capture_graph`): graphs replayed one
after another never need their intermediates at once. The decode and piecewise graphs
(graphs.py, piecewise.py) capture through the same two helpers.

`make_inputs(bs)` builds a bucket's static inputs, already valid padding (the caller loads a
step's rows over the first ones before each replay); `forward(inputs)` must run device ops
only — no host sync, no data-dependent shape — and returns the bucket's outputs, which the
graph rewrites on every replay. Buckets are captured largest first, sharing one memory pool
(which may be another graph set's).

Without CUDA (`capture=False`, tests) `replay` runs `forward` eagerly over the same static
buffers, so the loading and padding are checked on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

import torch

In = TypeVar("In")
Out = TypeVar("Out")
R = TypeVar("R")


@contextmanager
def capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A side stream that waits for the current one, current inside the block; the current
    stream waits for it at the end."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream(device).wait_stream(stream)


def capture_graph(
    fn: Callable[[], R], stream: torch.cuda.Stream, pool: object | None, warm: bool = True
) -> tuple[torch.cuda.CUDAGraph, R, object]:
    """`fn` captured into `pool` on `stream` (after one eager run, synchronized, unless `warm`
    is False: the caller ran it already); the graph, what the captured run returned (the static
    outputs a replay rewrites) and the pool for the next graph."""
    if warm:
        fn()
        torch.cuda.synchronize(stream.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out, graph.pool()


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
        with capture_stream(self.device) as stream, torch.inference_mode():
            for bs in reversed(self.sizes):
                bucket = self.buckets[bs]
                run = partial(self.forward, bucket.inputs)
                bucket.graph, bucket.outputs, pool = capture_graph(run, stream, pool)
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
