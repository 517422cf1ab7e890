"""Summarize the step trace of a `m3serve serve --enable-step-trace` log.

Per (step kind, batch size), over consecutive traced steps: how many, the median new tokens, the
median wall time from the previous step's line to this one's, and the median host time (planning +
processing, on the event loop) and run time (the executor thread: forward, sampling and the token
copy back, which waits for the device), with the run time's 99th percentile, the garbage collector's
pauses (`gc=`, and the part in full collections) summed, the range of the mixed steps' prompt
budgets (`budget=`), and where steps built their own batch in their launch (`build=`: their plan
came too late to build it ahead), how many and the median time. `--slowest N` lists the N steps
that took longest from the step before them (what an inter-token latency tail is made of), with
the part of the gap beyond the step's own run (large: the engine sat idle, or waited on
something outside the step), split into the executor's wait for the plan (`idle=`) and the
result's wait for the event loop (`lag=`), and with its launch beside the executor thread's CPU
time in it (`cpu=`: far below the launch, the thread was kept from running) and the OS's
preemptions of it (`preempted=`: the engine was short of CPU, not of the GIL); where the trace
logged them, the medians of `wait=` (while the step ran, the executor's wait for the plan after
next: the round trip through the event loop) and `ahead=` (building or launching that step),
and that launch's time by the kind of the step launched (`launches_by_kind`);
`--since` / `--until` keep the steps logged inside a window (one benchmark level of a longer
run), as HH:MM:SS of the log's clock. The CUDA allocator's logged retries and new device
allocations (cudaMalloc) in the window are summed at the end, by the steps they happened in.

`--itl` rebuilds the gaps between a request's tokens from the trace alone (`token_gaps`) and
prints their percentiles with what the tail is made of: on the H200 slice at C = 16 they came
to 2.31 / 7.68 ms (p50 / p99) where the clients measured 2.37 / 7.71, so a log is enough to
ask where an ITL tail comes from. A gap counts once per decode row that sees it (`itl_rows`),
as a client's per-token percentiles do; counted once per step, the small batches of a level's
drain (many steps, few tokens) weigh as much as full ones. Take a level's window from its JSON
(`clock`): a decode probe's pure decode steps inside it read as the level's (H200, 12-05,
C = 64 in its own window: p50 / p99 4.70 / 7.94 ms, the clients 3.87 / 8.95; with the probe in
it, 2.68 / 7.60).

`--chunk-cost` tabulates what a prompt chunk costs beside the decode rows of a step: the median
run of the mixed steps by decode rows (up to 16, 64, 256, more) and prompt tokens (bins of 64;
a step's prompt tokens taken as its tokens less its rows but one: one prompt chunk a step),
against the median pure decode step of the same rows. Whether a smaller chunk makes a faster
step is what the mixed-step budget assumes (on an H100, 12-05: beside 16 rows, 4.4-4.6 ms from
0 to 255 prompt tokens, 1.83 ms without).

Collections of a millisecond or more (the engine's `gc pause ...` lines) are counted by
generation and thread at the end, with the objects they freed.

    python perf/summarize_step_trace.py serve.log [--top 25] [--slowest 10] [--itl]
        [--chunk-cost] [--since 16:17:05 --until 16:17:08]
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import NamedTuple, TypeVar

LINE = re.compile(
    r"^(\S+ \S+) .*step (\d+) (\w+) batch=(\d+) tokens=(\d+).*host=([\d.]+)ms "
    r"\(plan ([\d.]+) \+ process ([\d.]+)\) run=([\d.]+)ms"
    r"(?: idle=([\d.]+)ms lag=([\d.]+)ms)?(?: launch=([\d.]+)ms)?"
    r"(?: gc=([\d.]+)ms(?:\(full ([\d.]+)\))?)?"
    r"(?: budget=(\d+)(?:\((\d+) rows\))?)?(?: build=([\d.]+)ms)?"
    r"(?: cpu=([\d.]+)ms)?(?: preempted=(\d+))?(?: device=([\d.]+)ms)?"
    r"(?: wait=([\d.]+)ms ahead=([\d.]+)ms)?"
)


PAUSE = re.compile(
    r"^(\S+ \S+) .*gc pause ([\d.]+) ms: generation (-?\d+), (\d+) objects freed, "
    r"in thread (\S+)"
)


ALLOC = re.compile(
    r"^(\S+ \S+) .*CUDA allocator: (\d+) allocations (retried|took new device memory).* "
    r"in steps (\d+)-(\d+)"
)


class Allocs(NamedTuple):
    """One logged rise of the CUDA allocator's counts (core/trace.py `AllocWatch`)."""

    stamp: float
    count: int
    kind: str  # "retried" or "took new device memory"
    first: int  # the steps it happened in
    last: int


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
    gc_ms: float = 0.0  # the garbage collector's pauses in the step (`gc=`, traced servers)
    budget: int = 0  # a mixed step's prompt budget (`budget=`; 0: not logged)
    idle_ms: float = 0.0  # the executor's wait for this plan (`idle=`; older logs: 0)
    lag_ms: float = 0.0  # the result's wait for the event loop (`lag=`)
    launch_ms: float = 0.0  # the run until its kernels were queued (`launch=`; 0: not logged)
    gc_full_ms: float = 0.0  # the part of gc_ms in full collections (`gc=...(full N)`)
    build_ms: float = 0.0  # the launch's share building the batch (`build=`; 0: built ahead)
    launch_cpu_ms: float = 0.0  # the executor thread's CPU time in the launch (`cpu=`)
    preempted: int = 0  # the OS's involuntary switches away from it in the run (`preempted=`)
    device_ms: float = 0.0  # its kernels' device time (`device=`; 0: not logged)
    # While it ran: the wait for the plan after next, and building or launching that step
    # (`wait=`, `ahead=`; 0: not logged).
    wait_ms: float = 0.0
    ahead_ms: float = 0.0
    # The decode batch a mixed step's budget was sized for, where more than it decoded
    # (`budget=N(R rows)`; 0: its own rows, or not logged).
    budget_rows: int = 0


class Pause(NamedTuple):
    """One logged garbage collection of a millisecond or more (`gc pause ...`)."""

    stamp: float
    ms: float
    generation: int
    freed: int
    thread: str


Row = TypeVar("Row", Step, Pause, Allocs)


def _stamp(clock: str) -> float:
    return datetime.strptime(clock, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_trace(path: Path) -> tuple[list[Step], list[Pause]]:
    """The step lines and the `gc pause` lines of a log, in one pass over it."""
    rows, pauses = [], []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if m is None:
            p = PAUSE.search(line)
            if p:
                pauses.append(Pause(_stamp(p[1]), float(p[2]), int(p[3]), int(p[4]), p[5]))
            continue
        numbers = (float(m[i]) for i in (6, 7, 8, 9))
        optional = (float(m[i]) if m[i] else 0.0 for i in (10, 11, 12, 13, 14, 17, 18))
        idle, lag, launch, gc_ms, full, build, cpu = optional
        budget, budget_rows, preempted = (int(m[i]) if m[i] else 0 for i in (15, 16, 19))
        device = float(m[20]) if m[20] else 0.0
        wait, ahead = (float(m[i]) if m[i] else 0.0 for i in (21, 22))
        head = (_stamp(m[1]), int(m[2]), m[3], int(m[4]), int(m[5]), *numbers)
        tail = (gc_ms, budget, idle, lag, launch, full, build, cpu, preempted, device, wait, ahead)
        rows.append(Step(*head, *tail, budget_rows))
    return rows, pauses


def allocator_lines(path: Path) -> list[Allocs]:
    """The CUDA allocator's logged retries and new device allocations, in log order."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        m = ALLOC.search(line)
        if m:
            found.append(Allocs(_stamp(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])))
    return found


def steps(path: Path) -> list[Step]:
    return read_trace(path)[0]


def gc_pauses(path: Path) -> list[Pause]:
    return read_trace(path)[1]


def _pairs(rows: list[Step]) -> list[tuple[Step, Step]]:
    """(step before, step) for each step that directly follows the step before it."""
    return [(prev, cur) for prev, cur in itertools.pairwise(rows) if cur.step == prev.step + 1]


def consecutive(rows: list[Step]) -> list[tuple[float, Step]]:
    """Each step that directly follows the step before it, with the wall time between their
    lines in ms."""
    return [(1e3 * (cur.stamp - prev.stamp), cur) for prev, cur in _pairs(rows)]


def launches_by_kind(rows: list[Step]) -> dict[str, list[float]]:
    """The host time of launching each step ahead, by that step's kind: a step's `ahead=` is
    the launch of the step after it, made while it ran. A mixed step launched behind a shorter
    decode step leaves the device idle for the difference (on an H200's host, 12-07: mixed
    steps' launches ~3.7 ms, the decode steps they followed 1.3 ms)."""
    launches: dict[str, list[float]] = defaultdict(list)
    for prev, cur in _pairs(rows):
        if prev.ahead_ms:
            launches[cur.kind].append(prev.ahead_ms)
    return launches


def in_window(rows: list[Row], since: str | None, until: str | None) -> list[Row]:
    """The rows logged at or after `since` and before `until` (HH:MM:SS[.fff] of the day of
    the first row)."""
    if not rows:
        return rows
    day = datetime.fromtimestamp(rows[0].stamp).date().isoformat()

    def at(clock: str) -> float:
        return datetime.fromisoformat(f"{day} {clock}").timestamp()

    low = at(since) if since else float("-inf")
    high = at(until) if until else float("inf")
    return [r for r in rows if low <= r.stamp < high]


def token_gaps(rows: list[Step]) -> list[tuple[float, Step, Step]]:
    """(gap ms, step before, step) for each step with decode rows that directly follows
    another: the gap a request in both steps saw between its tokens. A run ends `idle=` +
    `run=` after the run before it, and its tokens reach the event loop `lag=` later, so
    gap = idle + run + lag - the previous lag (0.01 ms resolution, where the clock has ms)."""
    return [
        (cur.idle_ms + cur.run_ms + cur.lag_ms - prev.lag_ms, prev, cur)
        for prev, cur in _pairs(rows)
        if cur.kind != "prefill"
    ]


def itl_rows(step: Step) -> int:
    """The requests that get a token after a step's gap: its decode rows (a mixed step's prompt
    chunk, one a step, gives at most a first token)."""
    return step.batch - 1 if step.kind == "mixed" else step.batch


def _print_token_gaps(rows: list[Step]) -> None:
    gaps = token_gaps(rows)
    if not gaps:
        return
    weighted = [(g, itl_rows(cur)) for g, _, cur in gaps]
    p50, p90, p99 = (weighted_percentile(weighted, q) for q in (0.5, 0.9, 0.99))
    tokens = sum(w for _, w in weighted)
    print(
        f"--- inter-token gaps from the trace: n={tokens} tokens in {len(gaps)} steps "
        f"p50 {p50:.2f} p90 {p90:.2f} p99 {p99:.2f} ms (p99 / p50 {p99 / p50:.2f}); "
        "the gaps from p99 on, by steps:"
    )
    tail: dict[tuple[str, str], list[tuple[float, Step, Step]]] = defaultdict(list)
    for item in gaps:
        if item[0] >= p99:
            tail[(item[1].kind, item[2].kind)].append(item)
    for (before, kind), items in sorted(tail.items(), key=lambda kv: -len(kv[1])):
        run = statistics.mean(c.idle_ms + c.run_ms for _, _, c in items)
        lag = statistics.mean(c.lag_ms - b.lag_ms for _, b, c in items)
        print(
            f"{before:>7s} -> {kind:7s} n={len(items):4d} gap {run + lag:6.2f} ms = "
            f"idle + run {run:6.2f} + lag change {lag:+6.2f}"
        )


ROW_BUCKETS = (16, 64, 256)
CHUNK_BIN = 64


def row_bucket(rows: int) -> int:
    """The smallest of ROW_BUCKETS holding `rows` decode rows (0: more than all of them)."""
    return next((b for b in ROW_BUCKETS if rows <= b), 0)


def chunk_costs(rows: list[Step]) -> dict[tuple[int, int], list[Step]]:
    """The decode (prompt bin -1) and mixed steps by (row bucket, prompt-token bin)."""
    costs: dict[tuple[int, int], list[Step]] = defaultdict(list)
    for r in rows:
        if r.kind == "decode":
            costs[(row_bucket(r.batch), -1)].append(r)
        elif r.kind == "mixed":
            prompt = r.tokens - (r.batch - 1)
            costs[(row_bucket(r.batch - 1), prompt // CHUNK_BIN)].append(r)
    return costs


def _cost_cell(label: str, group: list[Step]) -> str:
    """Median run ms and count, and the median launch and device ms where the trace logged
    them."""
    run = statistics.median(r.run_ms for r in group)
    launches = [r.launch_ms for r in group if r.launch_ms]
    launch = f", launch {statistics.median(launches):.2f}" if launches else ""
    devices = [r.device_ms for r in group if r.device_ms]
    device = f", device {statistics.median(devices):.2f}" if devices else ""
    return f"{label}{run:.2f} (n {len(group)}{launch}{device})"


def _print_chunk_costs(rows: list[Step]) -> None:
    costs = chunk_costs(rows)
    print(
        f"--- median run ms of mixed steps by decode rows and prompt tokens (bins of {CHUNK_BIN})"
    )
    for bucket in sorted({b for b, _ in costs}, key=lambda b: b or 1 << 30):
        name = f"<= {bucket}" if bucket else f"> {ROW_BUCKETS[-1]}"
        decode = costs.get((bucket, -1))
        cells = [_cost_cell("decode ", decode) if decode else ""]
        for lo in sorted(k for b, k in costs if b == bucket and k >= 0):
            span = f"{lo * CHUNK_BIN}-{(lo + 1) * CHUNK_BIN - 1}"
            cells.append(_cost_cell(f"{span}: ", costs[(bucket, lo)]))
        print(f"rows {name:>6s}  " + "  ".join(c for c in cells if c))


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest rank."""
    return weighted_percentile([(v, 1) for v in values], q)


def weighted_percentile(values: list[tuple[float, int]], q: float) -> float:
    """`percentile` of the values each repeated its weight's times (value, weight >= 0)."""
    ordered = sorted(values)
    total = sum(w for _, w in ordered)
    rank = min(total, max(1, round(q * total)))
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= rank:
            return value
    return ordered[-1][0]


def _ahead(wait_ms: float, ahead_ms: float) -> str:
    return f" (wait {wait_ms:4.2f} ahead {ahead_ms:4.2f})"


def _ahead_medians(launched: list[Step]) -> str:
    """The medians of `wait=` and `ahead=` over the steps that launched one ahead."""
    if not launched:
        return ""
    wait = statistics.median(r.wait_ms for r in launched)
    return _ahead(wait, statistics.median(r.ahead_ms for r in launched))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--slowest", type=int, default=0)
    parser.add_argument("--itl", action="store_true", help="inter-token gaps from the trace")
    parser.add_argument("--chunk-cost", action="store_true", help="mixed steps by prompt chunk")
    parser.add_argument("--since")
    parser.add_argument("--until")
    args = parser.parse_args()
    logged, pauses = read_trace(args.log)
    rows = in_window(logged, args.since, args.until)
    print(f"{len(rows)} steps traced")
    timed = consecutive(rows)
    groups: dict[tuple[str, int], list[tuple[float, Step]]] = defaultdict(list)
    for gap, step in timed:
        groups[(step.kind, step.batch)].append((gap, step))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[: args.top]
    for (kind, batch), items in ranked:
        gap = statistics.median(g for g, _ in items)
        med = {f: statistics.median(getattr(r, f) for _, r in items) for f in Step._fields[4:]}
        budgets = sorted({r.budget for _, r in items if r.budget})
        p99 = percentile([r.run_ms for _, r in items], 0.99)
        paused = sum(r.gc_ms for _, r in items)
        full = sum(r.gc_full_ms for _, r in items)
        built = [r.build_ms for _, r in items if r.build_ms]
        print(
            f"{kind:7s} batch={batch:4d} n={len(items):5d} tokens~{med['tokens']:7.0f} "
            f"wall gap {gap:6.2f} ms  host {med['host_ms']:5.2f} (plan {med['plan_ms']:4.2f} "
            f"process {med['process_ms']:4.2f})  run {med['run_ms']:6.2f} ms (p99 {p99:6.2f})  "
            f"idle {med['idle_ms']:4.2f} lag {med['lag_ms']:4.2f}"
            + (f" launch {med['launch_ms']:4.2f}" if med["launch_ms"] else "")
            + (f" device {med['device_ms']:5.2f}" if med["device_ms"] else "")
            + _ahead_medians([r for _, r in items if r.ahead_ms])
            + (f" (built in it: n {len(built)}, {statistics.median(built):.2f})" if built else "")
            + (f"  gc {paused:.1f} ms in all" if paused else "")
            + (f" ({full:.1f} in full collections)" if full else "")
            + (f"  budget {budgets[0]}-{budgets[-1]}" if budgets else "")
        )
    if args.slowest:
        print(f"--- the {args.slowest} longest gaps from the step before")
        for gap, step in sorted(timed, key=lambda gs: -gs[0])[: args.slowest]:
            clock = datetime.fromtimestamp(step.stamp).strftime("%H:%M:%S.%f")[:-3]
            launch = f"  launch {step.launch_ms:.2f} (cpu {step.launch_cpu_ms:.2f})"
            print(
                f"{clock} step {step.step} {step.kind:7s} batch={step.batch:4d} "
                f"tokens={step.tokens:6d} gap {gap:7.2f} ms  run {step.run_ms:7.2f} ms  "
                f"host {step.host_ms:5.2f} ms  beyond run {gap - step.run_ms:7.2f} ms "
                f"(idle {step.idle_ms:.2f}, lag {step.lag_ms:.2f})"
                + (f"  gc {step.gc_ms:.2f} ms" if step.gc_ms else "")
                + (f" (full {step.gc_full_ms:.2f})" if step.gc_full_ms else "")
                + (f"  budget {step.budget}" if step.budget else "")
                + (launch if step.launch_ms else "")
                + (f"  preempted {step.preempted}" if step.preempted else "")
                + (f"  device {step.device_ms:.2f}" if step.device_ms else "")
                + (_ahead(step.wait_ms, step.ahead_ms) if step.ahead_ms else "")
            )
    launches = launches_by_kind(rows)
    if launches:
        print(
            "--- steps launched ahead, by kind (the `ahead=` of the step before): "
            + ", ".join(
                f"{kind} median {statistics.median(ms):.2f} ms (n {len(ms)})"
                for kind, ms in sorted(launches.items())
            )
        )
    if args.itl:
        _print_token_gaps(rows)
    if args.chunk_cost:
        _print_chunk_costs(rows)
    _print_gc_pauses(in_window(pauses, args.since, args.until))
    _print_allocations(in_window(allocator_lines(args.log), args.since, args.until))


def _print_allocations(reports: list[Allocs]) -> None:
    """What the allocator logged in the window: each a stall of a step in its range."""
    for kind in ("retried", "took new device memory"):
        mine = [r for r in reports if r.kind == kind]
        if mine:
            ranges = ", ".join(f"{r.first}-{r.last}: {r.count}" for r in mine[:8])
            more = " ..." if len(mine) > 8 else ""
            total = sum(r.count for r in mine)
            print(f"--- CUDA allocations that {kind}: {total} (by steps {ranges}{more})")


def _print_gc_pauses(pauses: list[Pause]) -> None:
    if not pauses:
        return
    total = sum(p.ms for p in pauses)
    print(f"--- collections of 1 ms or more: {len(pauses)}, {total:.1f} ms in all")
    groups: dict[tuple[int, str], list[Pause]] = defaultdict(list)
    for pause in pauses:
        groups[(pause.generation, pause.thread)].append(pause)
    for (generation, thread), group in sorted(groups.items()):
        ms = [p.ms for p in group]
        median, freed = statistics.median(ms), statistics.median(p.freed for p in group)
        print(
            f"generation {generation} in {thread}: n={len(group)} median {median:.2f} ms, "
            f"max {max(ms):.2f} ms, median {freed:.0f} objects freed"
        )


if __name__ == "__main__":
    main()
