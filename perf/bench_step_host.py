"""Where the host time of a served decode step goes: the engine's step runner on a checkpoint,
its steps built and launched ahead as the server does (`StepRunner.prepare`, --launch-ahead),
timed part by part on the host.

At concurrency 1 the server's decode step was bound by the host, not the device: on an H100
serving the 4-layer M3.1-shaped slice a batch-1 step ran 1.39 ms against 0.90 ms of device time,
the executor thread busy ~76 % of a core (perf/results/h100_2026-12-07e_sampler_chunks/). This
runs the same calls the executor makes for each step, without the event loop: for each batch
size, `--iters` steps of decode rows over `--context` tokens, each step's `prepare` (building the
batch, queueing its forward and draw) behind a spin kernel so that no call waits for the device,
then its `run` (taking the tokens), each batch size three ways: `rows`, the server's default
(the step's rows handed to the decode graph as they are, its tokens drawn there: core/graphs.py
`DecodeRows`); `batch`, the same with a forward batch built first and copied into the graph's
buffers (the server's way before rows); `eager`, the rows drawn outside the graph
(`Sampler.sample`, the way steps with penalties or logprobs go). Each part's host time is its
wall time around the call (inclusive: a part's time holds the parts it calls), median per step;
then, for the first batch size, torch's profiler (host time of each op and CUDA call, per step)
and cProfile (Python functions by their own time).

`--chunk P` times mixed steps instead, one way (`mixed`): beside the decode rows each step
carries a P-token chunk of a prompt (not its last: nothing sampled), on the slot after theirs,
cycling over the prompt's first four chunks so that it attends over 0-3 chunks before it, as a
served ~1K-token prompt does. A mixed step leaves the decode graph for the piecewise graphs and
the eager attention of each layer (core/piecewise.py), whose launch served steps overlap with
the step before: at 16 streams on an H100 it took ~2.6 ms of host time against ~3.2 ms of
device time (perf/results/h100_2026-12-07f_step_host/), and so it bounds how short a mixed step
can be made. The parts add the piecewise run, each layer's attention and its two calls, and the
draw of the sampled rows (in a head graph, `_head_draw`, or outside one, `_queue_draw`).

    python perf/bench_step_host.py --model-path DIR [--batches 1 16 64] [--context 1024]
        [--iters 300] [--profile-iters 100] [--greedy] [--chunk P] [--out PATH]

Prints tables; writes JSON to $OUT/bench_step_host.json when $OUT is set, else perf/results/
(or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from bench_mixed_step import add_copy_flag, runner_for
from result_json import write_result
from torch.profiler import ProfilerActivity, profile

import m3serve.core.step_ahead as step_ahead_module
import m3serve.core.step_runner as step_runner_module
from m3serve.core.step_runner import StepRunner
from m3serve.runtime.messages import SamplingParams, SeqStep, StepPlan

# Spin ahead of each step's launch (~3 ms at H100/H200 clocks): longer than its host work, so
# nothing the host does waits for the device, as while the step before runs when served.
SPIN_CYCLES = 5_000_000
WARM_STEPS = 20  # untimed steps first: the allocator, the staging ring, the first replays
CHUNKS_CYCLED = 4  # a mixed step's chunk is one of its prompt's first four, in turn
# The runner's parts timed, as (owner attribute path, dotted; method name); "" is the runner.
PARTS = [
    ("", "prepare"),
    ("", "_build"),
    ("", "_decode_rows"),
    ("slot_pages", "update"),
    ("slot_pages", "changes"),
    ("", "_launches_ahead"),
    ("", "_launch_ahead"),
    ("", "logits"),
    ("", "_graph_draw"),
    ("graphs", "run_and_draw"),
    ("graphs", "_load"),
    ("graphs", "_load_rows"),
    ("graphs", "_load_batch"),
    ("", "_queue_draw"),
    ("matchers", "fill"),
    ("sampler", "sample"),
    ("sampler", "_draw_on_device"),
    ("sampler", "_device_draw"),
    ("", "run"),
    ("", "_take_tokens"),
    ("", "_settle"),
    ("piecewise", "run"),
    ("piecewise", "_pad"),
    ("", "_head_draw"),
    ("heads", "run"),
    ("model", "compute_logits"),
    ("model.layers.0", "attend"),
    ("model.layers.1", "attend"),
    ("model.backend", "index_topk"),
    ("model.backend", "attention"),
]
# Module-level names the runner calls (in a step's run, and in a step launched ahead), timed
# likewise.
MODULE_PARTS = [
    (step_runner_module, ["Download", "upload", "start_span", "seconds_of"]),
    (step_ahead_module, ["Download", "start_span", "seconds_of"]),
]


class Timers:
    """Each part's wall time summed per step (a part called twice in a step counts both)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - started

        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()

    def medians_us(self) -> dict[str, float]:
        names = {name for step in self.steps for name in step}
        return {
            name: 1e6 * statistics.median(step.get(name, 0.0) for step in self.steps)
            for name in sorted(names)
        }


@contextmanager
def timed_parts(runner: StepRunner, timers: Timers) -> Iterator[None]:
    """The runner's parts wrapped by `timers` inside the block, put back after it."""
    undo: list[Callable[[], None]] = []
    for path, name in PARTS:
        owner: Any = runner
        for attr in path.split(".") if path else ():
            owner = getattr(owner, attr, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        label = f"{path}.{name}" if path else name
        setattr(owner, name, timers.wrap(label, fn))
        undo.append(lambda owner=owner, name=name, fn=fn: delattr_or_set(owner, name, fn))
    for module, names in MODULE_PARTS:
        for name in names:
            fn = getattr(module, name)
            setattr(module, name, timers.wrap(name, fn))
            undo.append(lambda module=module, name=name, fn=fn: setattr(module, name, fn))
    try:
        yield
    finally:
        for put_back in reversed(undo):
            put_back()


def delattr_or_set(owner: Any, name: str, fn: Any) -> None:
    """Put `fn` back: a bound method goes by dropping the instance attribute that hid it."""
    if name in vars(owner) and getattr(type(owner), name, None) is not None:
        delattr(owner, name)
    else:
        setattr(owner, name, fn)


class Steps:
    """Decode plans for `batch` slots over `context` tokens, one position further each step;
    with a `chunk`, each also carries a prompt chunk of that many tokens (the module's
    docstring)."""

    def __init__(
        self,
        batch: int,
        context: int,
        page: int,
        row_pages: int,
        greedy: bool,
        chunk: int = 0,
        vocab: int = 2,
    ) -> None:
        self.batch, self.context, self.page, self.row_pages = batch, context, page, row_pages
        self.params = SamplingParams(temperature=0.0) if greedy else SamplingParams(top_p=0.95)
        self.chunk, self.vocab = chunk, vocab
        self.step = 0

    def first(self) -> StepPlan:
        """The slots' first step: a one-token prompt at the context's end, the whole page list."""
        seqs = [
            SeqStep(
                [1 + b],
                self.context,
                list(range(b * self.row_pages, (b + 1) * self.row_pages)),
                slot=b,
                new_request=True,
            )
            for b in range(self.batch)
        ]
        slots = self.batch + (1 if self.chunk else 0)
        if self.chunk:  # the prompt's slot: started as the rows' are, its chunks come after
            seqs.append(SeqStep([1], 0, self._pages(self.batch), slot=self.batch, new_request=True))
        self.step = 1
        return StepPlan(
            step=0,
            seqs=seqs,
            sampling=dict.fromkeys(range(slots), self.params),
            prompt_ids={b: [1 + b] for b in range(slots)},
        )

    def _pages(self, slot: int) -> list[int]:
        return list(range(slot * self.row_pages, (slot + 1) * self.row_pages))

    def next(self) -> StepPlan:
        """A decode step: every slot's last token, no page change."""
        start = self.context + self.step
        seqs = [
            SeqStep(None, start, [], slot=b, page_start=self.row_pages) for b in range(self.batch)
        ]
        if self.chunk:
            at = self.chunk * (self.step % CHUNKS_CYCLED)
            ids = [1 + (at + i) * 7919 % (self.vocab - 1) for i in range(self.chunk)]
            pages = self._pages(self.batch)
            seqs.append(SeqStep(ids, at, pages, slot=self.batch, sample=False))
        plan = StepPlan(step=self.step, seqs=seqs)
        self.step += 1
        return plan


def one_step(runner: StepRunner, plan: StepPlan, spin: bool) -> tuple[float, float]:
    """(host seconds of `prepare`, of `run`) of one decode step launched ahead."""
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    started = time.perf_counter()
    runner.prepare(plan)
    prepared = time.perf_counter()
    runner.run(plan)
    return prepared - started, time.perf_counter() - prepared


WAYS = ("rows", "batch", "eager")
# A step with a prompt chunk builds its batch and draws after the piecewise graphs (in a head
# graph where the runner has them, core/head_draw.py).
MIXED_WAYS = ("mixed",)


@contextmanager
def way(runner: StepRunner, name: str) -> Iterator[None]:
    """Steps run `name`'s way (WAYS; the module's docstring)."""
    if name == "batch":
        runner._decode_rows = lambda seqs: None  # type: ignore[method-assign]
    elif name == "eager":
        runner._graph_draw = lambda *args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        vars(runner).pop("_decode_rows", None)
        vars(runner).pop("_graph_draw", None)


def measure(runner: StepRunner, steps: Steps, iters: int, spin: bool) -> dict[str, Any]:
    runner.run(steps.first())
    for _ in range(WARM_STEPS):
        one_step(runner, steps.next(), spin)
    timers = Timers()
    prepare, run = [], []
    with timed_parts(runner, timers):
        for _ in range(iters):
            a, b = one_step(runner, steps.next(), spin)
            prepare.append(a)
            run.append(b)
            timers.end_step()
    parts = timers.medians_us()
    return {
        "prepare_us": 1e6 * statistics.median(prepare),
        "run_us": 1e6 * statistics.median(run),
        "parts_us": parts,
    }


def profiles(runner: StepRunner, steps: Steps, iters: int, spin: bool) -> dict[str, str]:
    """torch's profiler table (host self time per op, per step) and cProfile's top functions."""
    on_gpu = runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            one_step(runner, steps.next(), spin)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    calls = defaultdict(int)
    for event in prof.key_averages():
        calls[event.key] = event.count
    launches = {
        key: count / iters
        for key, count in calls.items()
        if key.startswith(("cuda", "cu")) and on_gpu
    }
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        one_step(runner, steps.next(), spin)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return {"torch": table, "cprofile": text.getvalue(), "driver_calls_per_step": launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--profile-iters", type=int, default=100)
    parser.add_argument("--greedy", action="store_true", help="greedy rows (default: top-p .95)")
    parser.add_argument("--chunk", type=int, default=0, help="mixed steps with a P-token chunk")
    parser.add_argument("--out", type=Path)
    add_copy_flag(parser)
    args = parser.parse_args()
    # Each run (a batch size, a way) starts over at `context`; its steps reach this far.
    total = args.context + 1 + WARM_STEPS + args.iters + 2 * args.profile_iters
    # A chunk's slot follows the rows' and takes a row's pages: they must hold its prompt.
    total = max(total, CHUNKS_CYCLED * args.chunk)
    spare = 1 if args.chunk else 0
    batches = [b + spare for b in args.batches]
    runner = runner_for(args.model_path, batches, args.chunk, total, args.mxfp8_bf16_copy)
    page = runner.page_size
    row_pages = -(-(total + 1) // page)
    spin = runner.device.type == "cuda"
    runner.launch_ahead = spin  # the server's default: where launches are asynchronous
    rows: list[dict[str, Any]] = []
    found: dict[str, Any] = {}
    for batch in args.batches:
        for name in MIXED_WAYS if args.chunk else WAYS:
            vocab = runner.model.cfg.vocab_size
            steps = Steps(batch, args.context, page, row_pages, args.greedy, args.chunk, vocab)
            with way(runner, name):
                row = {"batch": batch, "way": name, **measure(runner, steps, args.iters, spin)}
                rows.append(row)
                if batch == args.batches[0]:
                    found[name] = profiles(runner, steps, args.profile_iters, spin)
    names = sorted({n for row in rows for n in row["parts_us"]})
    what = f"decode rows + a {args.chunk}-token chunk" if args.chunk else "decode"
    print(f"host µs per {what} step, median of {args.iters} (inclusive; device {runner.device});")
    print("r: rows into the graph, drawn there (served); b: a built batch, drawn there; e: rows,")
    print("drawn outside the graph (Sampler.sample)")
    print(f"{'part':<28}" + "".join(f"{'B' + str(r['batch']) + r['way'][0]:>10}" for r in rows))
    for label in ["prepare_us", "run_us"]:
        print(f"{label:<28}" + "".join(f"{r[label]:>10.1f}" for r in rows))
    for name in names:
        print(f"{name:<28}" + "".join(f"{r['parts_us'].get(name, 0.0):>10.1f}" for r in rows))
    for name, profiled in found.items():
        what = f"batch {args.batches[0]}, {name}, {args.profile_iters} steps"
        print(f"\n== torch profiler, {what}")
        print(profiled["torch"])
        print("driver calls per step:", profiled["driver_calls_per_step"])
        print(f"\n== cProfile, {what}")
        print(profiled["cprofile"])
    result = {
        "device": str(torch.cuda.get_device_name() if spin else runner.device),
        "context": args.context,
        "iters": args.iters,
        "greedy": args.greedy,
        "chunk": args.chunk,
        "rows": rows,
        "driver_calls_per_step": {n: p["driver_calls_per_step"] for n, p in found.items()},
    }
    print("wrote", write_result(result, "bench_step_host", args.out))


if __name__ == "__main__":
    main()
