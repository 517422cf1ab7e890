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

LINE = re.compile(
    r"^(\S+ \S+) .*step (\d+) (\w+) batch=(\d+) tokens=(\d+).*host=([\d.]+)ms "
    r"\(plan ([\d.]+) \+ process ([\d.]+)\) run=([\d.]+)ms"
)


def steps(path: Path) -> list[tuple[float, int, str, int, int, float, float, float, float]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            step, kind, batch, tokens = int(m[2]), m[3], int(m[4]), int(m[5])
            rows.append((stamp, step, kind, batch, tokens, *(float(m[i]) for i in (6, 7, 8, 9))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = steps(args.log)
    print(f"{len(rows)} steps traced")
    groups: dict[tuple[str, int], list[tuple[float, tuple]]] = defaultdict(list)
    for prev, cur in itertools.pairwise(rows):
        if cur[1] == prev[1] + 1:
            groups[(cur[2], cur[3])].append((1e3 * (cur[0] - prev[0]), cur))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[: args.top]
    for (kind, batch), items in ranked:

        def med(i: int, items: list[tuple[float, tuple]] = items) -> float:
            return statistics.median(row[i] for _, row in items)

        gap = statistics.median(g for g, _ in items)
        print(
            f"{kind:7s} batch={batch:4d} n={len(items):5d} tokens~{med(4):7.0f} "
            f"wall gap {gap:6.2f} ms  host {med(5):5.2f} (plan {med(6):4.2f} "
            f"process {med(7):4.2f})  run {med(8):6.2f} ms"
        )


if __name__ == "__main__":
    main()
