"""What a step that carries prompt tokens costs beside the decode rows it runs with, and where.

The engine's own step path on a checkpoint (`StepRunner.time_step`, with the decode CUDA graphs
and the piecewise prefill graphs captured as `m3serve serve` captures them): for each decode
batch B, a pure decode step, then B decode rows plus a prompt chunk of each of `--chunks`
tokens. Per step: wall ms (synchronized: host and device), host ms (until the step's kernels
are all queued, from an idle device: where it nears the wall, the host sets the pace),
device-busy ms (the sum of its kernels' times, torch profiler; GPU only) and kernel launches.
The summary line fits mixed(B, P) = decode(B) + fixed + P x per-token, which is the model the
mixed-step budget uses (`core/step_cost.py`), and says whether the fixed part is host-bound
(wall above device-busy). On a backend that replays the first layer's attention launches for
the other layers (hopper, `kernels/triton/launches.py`), mixed steps are also timed with every
layer launched through Triton (`no-replay host ms`): the replay's saving, in the same run.

    python perf/bench_mixed_step.py --model-path DIR [--batches 1 16 64] [--chunks 128 512 1024]
        [--context 1024] [--top 12] [--traces] [--no-mxfp8-bf16-copy]

`--top N` prints the N ops with the most device time (CPU time on a CPU) of the mixed step of
the middle batch and the smallest chunk, and on a GPU also the N with the most host time, then
its kernels' device time beside the pure decode step's of that batch, by kernel name (where the
mixed step's fixed part goes; kernels launched with programmatic dependent launch count the
time they wait on their predecessor too). `--traces` writes both steps' profiler traces
(chrome://tracing JSON) beside the JSON. The checkpoint loads as the server's does, MXFP8
projections also held in bf16 unless `--no-mxfp8-bf16-copy`. JSON goes to
$OUT/bench_mixed_step.json when $OUT is set, else perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from m3serve.backends import auto_backend, create_backend
from m3serve.core.engine_start import capture_heads
from m3serve.core.graphs import DecodeGraphs
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.piecewise import PiecewiseGraphs
from m3serve.core.sampler import Sampler
from m3serve.core.step_cost import best_ms, fit_per_token
from m3serve.core.step_runner import StepRunner
from m3serve.model.build import load_model, resolve_device
from m3serve.model.kv_cache import KVCache
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import SeqStep
from m3serve.runtime.sections import KernelArgs


def runner_for(
    path: str, batches: list[int], chunk: int, context: int, mxfp8_bf16_copy: bool = False
) -> StepRunner:
    """The engine's step runner on the checkpoint, its CUDA graphs captured where the backend
    can: KV pages for every decode row and the chunk, plus the graphs' scratch page (the last)."""
    device = resolve_device("auto")
    backend = create_backend(auto_backend(device), device, mxfp8_bf16_copy=mxfp8_bf16_copy)
    loaded = load_model(path, backend, "auto", progress=False)
    model, cfg = loaded.model, loaded.model.cfg
    page = cfg.page_size
    row_pages = -(-(context + 1) // page)
    usable = max(batches) * row_pages + -(-chunk // page)
    kv = KVCache.allocate(cfg, usable + 1, model.dtype, device)
    sampler = Sampler(max(batches), cfg.vocab_size, device)
    runner = StepRunner(model, kv, page, sampler, GrammarMatchers(cfg.vocab_size), {}, None)
    # Slot page lists on the device, as the engine core keeps them: decode steps go to the
    # graphs as their rows (core/graphs.py `DecodeRows`), as served.
    runner.slot_pages = SlotPages(sampler.num_slots, kv.num_pages, device)
    if backend.capturable:
        # Drawing their rows' tokens themselves, as the server's do (core/graphs.py).
        draw = runner.graph_draw()
        runner.graphs = DecodeGraphs(model, kv, usable, max(batches), row_pages, draw)
        runner.graphs.capture()
        runner.piecewise = PiecewiseGraphs(model, kv, usable, max(batches) + chunk)
        runner.piecewise.capture()
        runner.heads = capture_heads(model, runner, draw, max(batches))
    return runner


def add_copy_flag(parser: argparse.ArgumentParser) -> None:
    """`--mxfp8-bf16-copy`: the server's flag, with the server's default."""
    parser.add_argument(
        "--mxfp8-bf16-copy",
        action=argparse.BooleanOptionalAction,
        default=KernelArgs().mxfp8_bf16_copy,
    )


def step(batch: int, chunk: int, page: int, context: int, vocab: int) -> list[SeqStep]:
    """`batch` decode rows over `context` tokens each, then a fresh `chunk`-token prompt of
    distinct tokens (so that routing spreads as real text does)."""
    row_pages = -(-(context + 1) // page)
    rows = [
        SeqStep([1 + b % (vocab - 1)], context, list(range(b * row_pages, (b + 1) * row_pages)))
        for b in range(batch)
    ]
    if not chunk:
        return rows
    first = batch * row_pages
    ids = [1 + (i * 7919) % (vocab - 1) for i in range(chunk)]
    return [*rows, SeqStep(ids, 0, list(range(first, first + -(-chunk // page))))]


def profiled(runner: StepRunner, seqs: list[SeqStep], sync: Any) -> tuple[float, int, Any]:
    """(device-busy ms, kernel launches, the profile) of one step."""
    on_gpu = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        runner.time_step(seqs)
        sync()
    if not on_gpu:
        return float("nan"), 0, prof
    kernels = kernel_us(prof).values()
    return sum(us for us, _ in kernels) / 1e3, sum(n for _, n in kernels), prof


def kernel_us(prof: Any) -> dict[str, tuple[float, int]]:
    """Device µs and launches per kernel name of one profiled step."""
    totals: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us, n = totals.get(e.name, (0.0, 0))
            totals[e.name] = (us + e.time_range.elapsed_us(), n + 1)
    return totals


def print_kernel_diff(decode: Any, mixed: Any, top: int) -> None:
    """The `top` kernels whose device time differs most between the two steps."""
    a, b = kernel_us(decode), kernel_us(mixed)
    names = sorted(
        a.keys() | b.keys(), key=lambda n: -abs(b.get(n, (0, 0))[0] - a.get(n, (0, 0))[0])
    )
    print(f"{'kernel':<48} {'decode us':>10} {'n':>4} {'mixed us':>10} {'n':>4} {'delta':>9}")
    for name in names[:top]:
        (du, dn), (mu, mn) = a.get(name, (0.0, 0)), b.get(name, (0.0, 0))
        print(f"{name[:48]:<48} {du:10.1f} {dn:4d} {mu:10.1f} {mn:4d} {mu - du:+9.1f}")
    total_a = sum(us for us, _ in a.values())
    total_b = sum(us for us, _ in b.values())
    delta = total_b - total_a
    print(f"{'all kernels':<48} {total_a:10.1f} {'':>4} {total_b:10.1f} {'':>4} {delta:+9.1f}")


def host_ms(run: Callable[[], None], sync: Callable[[], None], repeats: int = 3) -> float:
    """The fastest of `repeats` times until `run` returns, each from an idle device: the host
    part of a step (a mixed step returns once its kernels are queued; a decode step waits for
    its tokens, so there it is the wall)."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        best = min(best, 1e3 * (time.perf_counter() - started))
    sync()
    return best


def host_ms_without_replay(
    runner: StepRunner, run: Callable[[], None], sync: Callable[[], None]
) -> float | None:
    """`host_ms` with every layer's attention launched through Triton; None where the
    backend replays nothing."""
    calls = getattr(runner.model.backend, "layer_calls", None)
    if calls is None:
        return None
    calls.replay = False
    try:
        return host_ms(run, sync)
    finally:
        calls.replay = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--traces", action="store_true")
    add_copy_flag(parser)
    args = parser.parse_args()
    out = args.out or Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = out / "bench_mixed_step.json" if out.suffix != ".json" else out
    runner = runner_for(
        args.model_path, args.batches, max(args.chunks), args.context, args.mxfp8_bf16_copy
    )
    page, vocab = runner.page_size, runner.model.cfg.vocab_size
    device = runner.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows: list[dict[str, Any]] = []
    profiles = {}
    key = (args.batches[len(args.batches) // 2], min(args.chunks))
    # Exported as soon as each is profiled: exported after the later steps' profiles, every
    # kernel came out at 0 µs (an H100, torch 2.11, 2026-12-06).
    traced = {(key[0], 0): "decode", key: "mixed"} if args.traces else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for batch in args.batches:
            for chunk in (0, *args.chunks):
                seqs = step(batch, chunk, page, args.context, vocab)
                wall = best_ms(lambda seqs=seqs: runner.time_step(seqs), sync)
                host = host_ms(lambda seqs=seqs: runner.time_step(seqs), sync)
                plain = None
                if chunk:
                    plain = host_ms_without_replay(
                        runner, lambda seqs=seqs: runner.time_step(seqs), sync
                    )
                busy, launches, prof = profiled(runner, seqs, sync)
                profiles[(batch, chunk)] = prof
                if (batch, chunk) in traced:
                    trace = out.parent / f"trace_{traced[batch, chunk]}.json"
                    prof.export_chrome_trace(str(trace))
                rows.append(
                    {"batch": batch, "chunk": chunk, "wall_ms": wall, "host_ms": host,
                     "host_ms_no_replay": plain, "device_busy_ms": busy, "launches": launches}
                )  # fmt: skip
        prefill = {
            c: best_ms(lambda c=c: runner.time_step(step(0, c, page, 0, vocab)), sync)
            for c in args.chunks
        }
    per_token = fit_per_token(prefill)
    decode = {r["batch"]: r["wall_ms"] for r in rows if r["chunk"] == 0}
    for r in rows:
        if r["chunk"]:
            r["fixed_ms"] = r["wall_ms"] - decode[r["batch"]] - per_token * r["chunk"]
    print(
        f"{'batch':>5} {'chunk':>6} {'wall ms':>8} {'host ms':>8} {'no-replay host ms':>17} "
        f"{'busy ms':>8} {'launches':>8} {'fixed ms':>9}"
    )
    for r in rows:
        fixed = f"{r['fixed_ms']:9.2f}" if "fixed_ms" in r else f"{'-':>9}"
        plain = r["host_ms_no_replay"]
        plain_text = f"{plain:17.2f}" if plain is not None else f"{'-':>17}"
        print(
            f"{r['batch']:5d} {r['chunk']:6d} {r['wall_ms']:8.2f} {r['host_ms']:8.2f} "
            f"{plain_text} {r['device_busy_ms']:8.2f} {r['launches']:8d} {fixed}"
        )
    mixed = [r for r in rows if r["chunk"]]
    fixed = sorted(r["fixed_ms"] for r in mixed)[len(mixed) // 2]
    if device.type == "cuda":
        host_bound = sum(r["wall_ms"] > 1.2 * r["device_busy_ms"] for r in mixed)
        bound = f"{host_bound}/{len(mixed)} mixed steps have wall > 1.2x device-busy (host-bound)"
    else:
        bound = "device-busy: GPU only"
    print(
        f"prefill {1e3 * per_token:.1f} us/token; fixed cost per mixed step (median) "
        f"{fixed:.2f} ms; {bound}"
    )
    replayed = [r for r in mixed if r["host_ms_no_replay"] is not None]
    if replayed:
        ratio = sorted(r["host_ms"] / r["host_ms_no_replay"] for r in replayed)[len(replayed) // 2]
        print(f"layer replay: a mixed step's host ms {ratio:.2f}x launching every layer (median)")
    if args.top:
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"== top ops of the mixed step batch {key[0]} + chunk {key[1]}")
        averages = profiles[key].key_averages()
        print(averages.table(sort_by=sort, row_limit=args.top))
        if device.type == "cuda":  # and where its host time went
            print(f"== top host ops of the mixed step batch {key[0]} + chunk {key[1]}")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
            print(f"== kernels of the mixed step beside the decode step of batch {key[0]}")
            print_kernel_diff(profiles[(key[0], 0)], profiles[key], args.top)
    result = {
        "benchmark": "bench_mixed_step",
        "model_path": args.model_path,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "context": args.context,
        "prefill_ms_per_token": per_token,
        "fixed_ms_median": fixed,
        "mxfp8_bf16_copy": args.mxfp8_bf16_copy,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
