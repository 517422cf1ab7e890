"""A step's device span (core/device_clock.py) times its own kernels: queued behind other work,
it starts where the device reaches it; it reads None until its end is reached, and no span
starts while a CUDA graph is being captured."""

from __future__ import annotations

import torch

from m3serve.core.device_clock import start_span


def _matmuls(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x @ x


def _span_of_matmuls(x: torch.Tensor, n: int) -> float:
    """The device span of `n` matmuls queued now, read once they are done."""
    span = start_span(x.device)
    assert span is not None
    _matmuls(x, n)
    span.stop()
    torch.cuda.synchronize()
    seconds = span.seconds()
    assert seconds is not None
    return seconds


def test_a_span_queued_behind_other_work_times_only_its_own_kernels() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    _matmuls(x, 3)
    torch.cuda.synchronize()
    own = _span_of_matmuls(x, 10)  # from an idle device
    assert own > 0
    _matmuls(x, 40)  # queued before the span: not its time
    queued = _span_of_matmuls(x, 10)
    assert queued < 2 * own  # 50 matmuls' time would be ~5x


def test_a_span_reads_none_until_its_end_is_reached() -> None:
    device = torch.device("cuda")
    x = torch.randn(8192, 8192, device=device)
    span = start_span(device)
    assert span is not None
    assert span.seconds() is None  # not stopped
    _matmuls(x, 20)
    span.stop()
    assert span.seconds() is None  # ~1 s of matmuls still queued ahead of its end
    torch.cuda.synchronize()
    assert span.seconds() is not None


def test_no_span_starts_while_a_graph_is_captured() -> None:
    device = torch.device("cuda")
    x = torch.randn(64, 64, device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        x @ x  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    spans = []
    with torch.cuda.graph(graph):
        spans.append(start_span(device))
        x @ x
    assert spans == [None]
