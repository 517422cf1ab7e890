"""What a serving step's host chain waits on, on the machine it runs on: a Python loop's speed
(the planning and launching are Python), timer sleeps and `Condition.wait` with the executor's
0.2 ms poll, a cross-thread hand-over (a result out, a plan in), and the host's wait for a CUDA
event. Written in stop 54 for the next device call; not yet run there.

    python3 perf/results/h100_2026-12-07b_t1_inflight/wake.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, "perf")  # run from the repo root
from summarize_step_trace import percentile


def percentiles(seconds: list[float]) -> str:
    p50, p90, p99 = (1e6 * percentile(seconds, q) for q in (0.5, 0.9, 0.99))
    return f"p50 {p50:8.1f} µs  p90 {p90:8.1f}  p99 {p99:8.1f}"


def timed(fn: Callable[[], object], n: int = 2000) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def python_loop() -> int:
    total = 0
    for i in range(100_000):
        total += i * i
    return total


def condition_wait(cond: threading.Condition) -> None:
    with cond:
        cond.wait(0.0002)


def hand_over(n: int = 2000) -> list[float]:
    """How long after one thread sets an Event the waiting thread runs."""
    go, back = threading.Event(), threading.Event()
    woke: list[float] = []

    def waiter() -> None:
        for _ in range(n):
            go.wait()
            woke.append(time.perf_counter())
            go.clear()
            back.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    latencies = []
    for _ in range(n):
        time.sleep(0.0005)
        t = time.perf_counter()
        go.set()
        back.wait()
        back.clear()
        latencies.append(woke[-1] - t)
    thread.join()
    return latencies


def cuda_event_wait() -> None:
    import torch

    if not torch.cuda.is_available():
        print("CUDA event wait: no GPU")
        return
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    waits = []
    for _ in range(300):
        for _ in range(3):
            x @ x
        done = torch.cuda.Event()
        done.record()
        t = time.perf_counter()
        done.synchronize()
        waits.append(time.perf_counter() - t)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        x @ x
    end.record()
    end.synchronize()
    device_us = 1000 * start.elapsed_time(end)
    print(f"CUDA event wait (3 matmuls, {device_us:.0f} µs on the device):", percentiles(waits))


def main() -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = cpuinfo.split("model name")[1].split("\n")[0].strip(" :\t") if cpuinfo else "?"
    print(f"{os.cpu_count()} CPUs, {model}")
    print("Python loop of 1e5 steps:", percentiles(timed(python_loop, 50)))
    print("time.sleep(0.2 ms):      ", percentiles(timed(lambda: time.sleep(0.0002))))
    cond = threading.Condition()
    print("Condition.wait(0.2 ms):  ", percentiles(timed(lambda: condition_wait(cond))))
    print("Event set -> other thread:", percentiles(hand_over()))
    cuda_event_wait()


if __name__ == "__main__":
    main()
