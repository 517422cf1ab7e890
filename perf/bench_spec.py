"""Speculative decoding (DSpark) cost and speedup at a fixed acceptance length.

On the engine core: a checkpoint with a `dspark/` draft (`--model-path`; by default a tiny one
with a random draft, written to a temporary directory). Per batch size: decode tokens/s per
request with speculation off, and on with `--speculative-accept-length-override L` (verify steps
commit L tokens on average whatever the random draft proposed — the issue's benchmark mode; a
fractional L such as 3.07 mixes its two nearest lengths), next to the ideal L / (relative step
cost), where the relative step cost is a verify step's time over a plain decode step's, both
measured in this run. One engine per setting (off, each L), every batch size run in it in turn:
greedy requests, ignore_eos, every request prefilled and `--warm-steps` steps run before the
timed steps, which go through the overlap loop as a server's do (`--no-overlap`: one after
another). Prints a table and writes JSON.

    python perf/bench_spec.py [--batch 1 8 32] [--accept 3.07 5] [--new 48] [--prompt 64]
        [--model-path DIR] [--backend reference|hopper] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--disable-cuda-graph] [--no-overlap] [--out FILE]

On the H200 (the draft and verify CUDA graphs are on unless `--disable-cuda-graph`; the warm-up
is skipped, and the untimed steps take the first launches):

    python perf/bench_spec.py --model-path /slice --backend hopper --device cuda \
        --dtype bfloat16 --prompt 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from m3serve.core.engine_core import EngineCore
from m3serve.core.req import Req
from m3serve.model.tiny.checkpoint import TinySpec, make_tiny
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams


def engine(path: Path, accept: float | None, server: dict[str, Any]) -> EngineCore:
    """An engine with speculation off (`accept` None) or on at that fixed acceptance length."""
    spec: dict[str, Any] = {}
    if accept is not None:
        spec = {"speculative_algorithm": "DSPARK", "speculative_accept_length_override": accept}
    args = ServerArgs.from_kwargs(model_path=str(path), **server, **spec)
    return EngineCore(args, path)


def decode_rate(
    core: EngineCore, batch: int, prompt: int, new: int, warm: int, overlap: bool
) -> dict[str, float]:
    """Decode tokens/s per request and seconds per step of `batch` requests on `core`: the timed
    window opens once every request is prefilled and `warm` steps have run, and closes when the
    requests have made `new` tokens each on average, or one of them finishes, so every timed
    step carries the whole batch (requests prefilled early decode while later ones prefill, and
    would otherwise finish before the window and leave it a shrinking batch)."""
    # Room for the decode steps beside the later prefills; the window closes long before.
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2 * new + warm, ignore_eos=True)
    reqs = [
        Req(f"b{batch}r{i}", [(i * 13 + j) % 400 + 8 for j in range(prompt)], sampling,
            frozenset(), 0)
        for i in range(batch)
    ]  # fmt: skip
    step = core.overlap_step if overlap else core.step

    async def go() -> tuple[float, int, int]:
        for req in reqs:
            core.add(req)
        while any(not r.output for r in reqs):  # prefill everyone first
            await core.step()
        for _ in range(warm):
            await core.step()
        done_before = sum(len(r.output) for r in reqs)
        steps, started = 0, time.perf_counter()
        timed = 0
        while timed < new * batch and not any(r.finish for r in reqs):
            await step()
            steps += 1
            timed = sum(len(r.output) for r in reqs) - done_before
        seconds = time.perf_counter() - started
        for req in reqs:
            core.abort(req.rid)
        while core.has_work or core._in_flight is not None:
            await step()
        return seconds, steps, timed

    seconds, steps, tokens = asyncio.run(go())
    return {
        "tok_s_per_request": tokens / batch / seconds,
        "step_s": seconds / steps,
        "tokens_per_step_per_request": tokens / steps / batch,
    }


def rates(
    path: Path, accept: float | None, server: dict[str, Any], args: argparse.Namespace
) -> dict[int, dict[str, float]]:
    core = engine(path, accept, server)
    try:
        return {
            batch: decode_rate(core, batch, args.prompt, args.new, args.warm_steps, args.overlap)
            for batch in args.batch
        }
    finally:
        core.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--accept", type=float, nargs="+", default=[3.07, 5.0])
    parser.add_argument("--new", type=int, default=48, help="timed new tokens per request")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--warm-steps", type=int, default=3, help="untimed steps first")
    parser.add_argument("--model-path", type=Path, default=None, help="with a dspark/ draft")
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_spec_cpu.json"))
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false")
    args = parser.parse_args()
    server = {
        "backend": args.backend,
        "device": args.device,
        "dtype": args.dtype,
        "disable_cuda_graph": args.disable_cuda_graph,
        "max_total_tokens": max(65536, 2 * max(args.batch) * (args.prompt + 2 * args.new + 64)),
        "cuda_graph_max_bs_decode": max(args.batch),
        # Prefill is not timed: no piecewise graphs, no warm-up (the untimed steps compile).
        "cuda_graph_backend_prefill": "disabled",
        "mixed_step_stretch": 0.0,  # prefill is untimed: no prompt budget beside decodes
        "skip_warmup": True,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or make_tiny(
            Path(tmp) / "tiny", TinySpec(dtype="float32", dspark=True)
        )
        off = rates(path, None, server, args)
        on = {accept: rates(path, accept, server, args) for accept in args.accept}
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        base = off[batch]
        rows.append({"batch": batch, "accept": "off", **base, "speedup": 1.0, "ideal": 1.0})
        for accept, by_batch in on.items():
            mine = by_batch[batch]
            relative_cost = mine["step_s"] / base["step_s"]
            rows.append(
                {
                    "batch": batch,
                    "accept": accept,
                    **mine,
                    "relative_step_cost": relative_cost,
                    "speedup": mine["tok_s_per_request"] / base["tok_s_per_request"],
                    "ideal": accept / relative_cost,
                }
            )
    header = ("batch", 5), ("accept", 6), ("tok/s/req", 10), ("step ms", 8), ("speedup", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'ideal':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['accept']!s:>6} {r['tok_s_per_request']:>10.1f} "
            f"{r['step_s'] * 1e3:>8.2f} {r['speedup']:>8.2f} {r['ideal']:>6.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        **server,
        "prompt": args.prompt,
        "new": args.new,
        "overlap": args.overlap,
        "model_path": str(args.model_path) if args.model_path else "tiny (random draft)",
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
