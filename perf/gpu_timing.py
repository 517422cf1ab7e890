"""GPU timing for the benchmarks in perf/: CUDA-graph replay time of a set of calls, eager time,
and the device's own bandwidth (read-only stream, copy) and launch cost, measured in the same run
as the thing they are a floor for. Import it from a benchmark run as `python perf/bench_x.py`
(perf/ is then on sys.path)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

MAX_CAPTURED_CALLS = 256  # per graph: bounds capture time and the graph pool's scratch memory


def graph_us(calls: list[Callable[[], object]], budget_ms: float = 40.0) -> float:
    """Median µs per call, replaying `calls` round-robin from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:  # JIT compilation and first-touch allocations stay out of the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = int(budget_ms / (per_call_ms * len(calls)))
    rounds = max(1, min(rounds, MAX_CAPTURED_CALLS // len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in calls:
                fn()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(samples)


def eager_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _empty_kernel(x_ptr):
    pass


def read_bandwidth() -> float:
    """Device read bandwidth in bytes/s: a streaming sum over 4 GiB."""
    src = torch.ones(2**31, dtype=torch.bfloat16, device="cuda")
    programs = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(programs, device="cuda")
    us = graph_us(
        [lambda: _read_kernel[(programs,)](src, out, src.numel(), BLOCK=4096, num_warps=8)], 200.0
    )
    return src.numel() * 2 / (us * 1e-6)


def launch_us() -> float:
    """Per-launch cost of an empty 128-program kernel replayed from a graph."""
    x = torch.empty(1, device="cuda")
    return graph_us([lambda: _empty_kernel[(128,)](x)] * 8)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting the bytes read and written."""
    size = 2 * 2**30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)], budget_ms=200.0)
    return 2 * size / (us * 1e-6)  # both buffers are freed on return
