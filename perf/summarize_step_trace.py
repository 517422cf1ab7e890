"""Summarize the step trace of a `m3serve serve --enable-step-trace` log.

Per (step kind, batch size), over consecutive traced steps: how many, the median new tokens,
the median wall time from the previous step's line to this one's, and the median host time
(planning + processing, on the event loop) and run time (the executor thread: forward,
sampling and the token copy back, which waits for the device).

    python perf/summarize_step_trace.py serve.log [--top 25]
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

LINE = re.compile(
    r"^(\S+ \S+) .*step (\d+) (\w+) batch=(\d+) tokens=(\d+).*host=([\d.]+)ms "
    r"\(plan ([\d.]+) \+ process ([\d.]+)\) run=([\d.]+)ms"
)


class Step(NamedTuple):
    stamp: float  # the log line's time, seconds
    step: int
    kind: str
    batch: int
    tokens: int
    host_ms: float
    plan_ms: float
    process_ms: float
    run_ms: float


def steps(path: Path) -> list[Step]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if m:
            stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            numbers = (float(m[i]) for i in (6, 7, 8, 9))
            rows.append(Step(stamp, int(m[2]), m[3], int(m[4]), int(m[5]), *numbers))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = steps(args.log)
    print(f"{len(rows)} steps traced")
    # Each step with the wall time since the step before it (consecutive steps only).
    groups: dict[tuple[str, int], list[tuple[float, Step]]] = defaultdict(list)
    for prev, cur in itertools.pairwise(rows):
        if cur.step == prev.step + 1:
            groups[(cur.kind, cur.batch)].append((1e3 * (cur.stamp - prev.stamp), cur))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[: args.top]
    for (kind, batch), items in ranked:
        gap = statistics.median(g for g, _ in items)
        med = {f: statistics.median(getattr(r, f) for _, r in items) for f in Step._fields[4:]}
        print(
            f"{kind:7s} batch={batch:4d} n={len(items):5d} tokens~{med['tokens']:7.0f} "
            f"wall gap {gap:6.2f} ms  host {med['host_ms']:5.2f} (plan {med['plan_ms']:4.2f} "
            f"process {med['process_ms']:4.2f})  run {med['run_ms']:6.2f} ms"
        )


if __name__ == "__main__":
    main()
