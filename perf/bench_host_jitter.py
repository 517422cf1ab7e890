"""Stalls of the machine itself, without the server: is a burst of slow host work something the
engine does, or something done to every process on the host?

Served on lent H100s, the engine's executor thread had bursts of 50-100 ms in which all its host
work ran 5-20x slower (CPU time equal to wall time), every 1.2-1.7 s at concurrency 1, in pairs
~60 ms apart (perf/results/h100_2026-12-07f_step_host/, call 4's trace); an H200's trace of the
same load had two in 5777 steps. This runs, for `--seconds`, two processes side by side, each a
loop of the same small unit of work: `python` (pure Python, no device) and, where there is a GPU,
`cuda` (a tiny kernel launch and an event query, the calls a decode step is made of). Time is
cut in 2 ms windows; a window in which the process finished fewer than 1/`--slow` of its median
window's units is slow (a lone late unit, an interrupt, is not), and slow windows less than 20 ms
apart make one episode. Episodes in both processes at once point at the machine (its vCPUs
taken away, the host's memory); in `cuda` alone at the driver (another process holding it: a
monitor polling NVML); in neither at the server itself.

    python perf/bench_host_jitter.py [--seconds 10] [--slow 5] [--out PATH]

Prints each process's units, median and p99 µs, its episodes (start, length, the share of its
normal work done) with the median time between them (the server's came every 1.2-1.7 s), and
the episodes the two share; writes JSON to $OUT/bench_host_jitter.json when $OUT is set, else
perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from result_json import write_result

WINDOW_S = 0.002
GAP_S = 0.02  # slow windows closer than this make one episode
SHARED_S = 0.01  # episodes of the two processes this close count as one event
SHOWN = 20  # episodes printed per process (the JSON has all)


def python_unit() -> None:
    sum(i * i for i in range(300))


def run_loop(kind: str, seconds: float, queue: Any) -> None:
    """One process: (start time, µs) of every unit for `seconds`, put on `queue`."""
    unit = python_unit
    if kind == "cuda":
        import torch

        x = torch.zeros(1, device="cuda")
        event = torch.cuda.Event()

        def unit() -> None:  # a launch, and the query a step's hand-over makes
            x.add_(1)
            event.record()
            event.query()

        torch.cuda.synchronize()
    samples: list[tuple[float, float]] = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        unit()
        samples.append((now, 1e6 * (time.monotonic() - now)))
    queue.put((kind, samples))


def episodes(samples: list[tuple[float, float]], slow: float) -> list[dict[str, float]]:
    """Runs of slow windows (fewer than 1/`slow` of the median window's units finished),
    joined when less than GAP_S apart; each with the share of its normal work it got done."""
    t0 = samples[0][0]
    count: dict[int, int] = {}
    for start, us in samples:
        window = int((start + us / 1e6 - t0) / WINDOW_S)
        count[window] = count.get(window, 0) + 1
    last = max(count)
    done = [count.get(w, 0) for w in range(last)]  # the last window is cut short
    normal = statistics.median(done)
    found: list[dict[str, float]] = []
    for w, units in enumerate(done):
        if units * slow >= normal:
            continue
        start = t0 + w * WINDOW_S
        if found and start - found[-1]["stop"] < GAP_S:
            found[-1]["stop"] = start + WINDOW_S
            found[-1]["units"] += units
            found[-1]["windows"] += 1
        else:
            found.append({"start": start, "stop": start + WINDOW_S, "units": units, "windows": 1})
    for e in found:
        e["rate"] = e.pop("units") / (normal * e.pop("windows"))
    return found


def shared(a: list[dict[str, float]], b: list[dict[str, float]]) -> int:
    """How many of `a`'s episodes overlap one of `b`'s (within SHARED_S)."""
    return sum(
        any(x["start"] - SHARED_S < y["stop"] and y["start"] - SHARED_S < x["stop"] for y in b)
        for x in a
    )


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--slow", type=float, default=5.0, help="a stall: this x the median")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kinds = ["python", "cuda"] if cuda_available() else ["python"]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=run_loop, args=(k, args.seconds, queue)) for k in kinds]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    t0 = min(samples[0][0] for samples in results.values())
    report: dict[str, Any] = {"seconds": args.seconds, "slow": args.slow, "processes": {}}
    found = {}
    for kind in kinds:
        samples = results[kind]
        times = sorted(us for _, us in samples)
        found[kind] = episodes(samples, args.slow)
        report["processes"][kind] = {
            "units": len(samples),
            "median_us": statistics.median(times),
            "p99_us": times[int(0.99 * (len(times) - 1))],
            "max_us": times[-1],
            "episodes": [
                {**e, "start": e["start"] - t0, "stop": e["stop"] - t0} for e in found[kind]
            ],
        }
    print(
        f"{'process':<8} {'units':>9} {'median µs':>10} {'p99 µs':>8} {'max µs':>9} {'episodes':>9}"
    )
    for kind, row in report["processes"].items():
        print(
            f"{kind:<8} {row['units']:>9} {row['median_us']:>10.2f} {row['p99_us']:>8.2f} "
            f"{row['max_us']:>9.0f} {len(row['episodes']):>9}"
        )
    for kind, row in report["processes"].items():
        starts = [e["start"] for e in row["episodes"]]
        gaps = [b - a for a, b in pairwise(starts)]
        row["median_gap_s"] = statistics.median(gaps) if gaps else None
        if gaps:
            print(f"  {kind}: median {row['median_gap_s']:.3f} s between episodes")
        for e in row["episodes"][:SHOWN]:
            length = 1e3 * (e["stop"] - e["start"])
            print(
                f"  {kind:<6} at {e['start']:7.3f} s: {length:6.1f} ms, {e['rate']:.0%} of the rate"
            )
    if len(kinds) == 2:
        report["shared"] = shared(found["cuda"], found["python"])
        print(
            f"cuda episodes that the python process shared: {report['shared']} of "
            f"{len(found['cuda'])}"
        )
    write_result(report, "bench_host_jitter.json", args.out)


if __name__ == "__main__":
    main()
