"""Speculative decoding (DSpark) cost and speedup at a fixed acceptance length.

A tiny checkpoint with a random `dspark/` draft, on the engine core (reference backend, CPU by
default). Per batch size: decode tokens/s per request with speculation off, and on with
`--speculative-accept-length-override L` (each verify step commits exactly L tokens whatever
the random draft proposed — the issue's benchmark mode), next to the ideal L / (relative step
cost), where the relative step cost is a verify step's time over a plain decode step's, both
measured in this run. Greedy requests, ignore_eos, every request prefilled before timing.
Prints a table and writes JSON. On the H200: `--backend hopper --device cuda` (the draft and
verify CUDA graphs are on unless `--disable-cuda-graph`).

    python perf/bench_spec.py [--batch 1 8 32] [--accept 1 3 5] [--new 48] [--out FILE]
        [--backend reference|hopper] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--disable-cuda-graph]
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

PROMPT = 64


def decode_rate(
    path: Path, batch: int, new: int, accept: int | None, server: dict[str, Any]
) -> dict[str, float]:
    """Decode tokens/s per request and seconds per step, once every request is prefilled;
    `server`: more ServerArgs (backend, device, dtype, ...)."""
    spec = {} if accept is None else {"speculative_algorithm": "DSPARK"}
    if accept:
        spec["speculative_accept_length_override"] = accept
    args = ServerArgs.from_kwargs(model_path=str(path), max_total_tokens=65536, **server, **spec)
    core = EngineCore(args, path)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    reqs = [
        Req(f"r{i}", [(i * 13 + j) % 400 + 8 for j in range(PROMPT)], sampling, frozenset(), 0)
        for i in range(batch)
    ]

    async def go() -> tuple[float, int, int]:
        for req in reqs:
            core.add(req)
        while any(not r.output for r in reqs):  # prefill everyone first
            await core.step()
        done_before = sum(len(r.output) for r in reqs)
        steps, started = 0, time.perf_counter()
        while core.has_work:
            await core.step()
            steps += 1
        return time.perf_counter() - started, steps, sum(len(r.output) for r in reqs) - done_before

    try:
        seconds, steps, tokens = asyncio.run(go())
    finally:
        core.close()
    return {
        "tok_s_per_request": tokens / batch / seconds,
        "step_s": seconds / steps,
        "tokens_per_step_per_request": tokens / steps / batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--accept", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--new", type=int, default=48, help="new tokens per request")
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_spec_cpu.json"))
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    args = parser.parse_args()
    server = {
        "backend": args.backend,
        "device": args.device,
        "dtype": args.dtype,
        "disable_cuda_graph": args.disable_cuda_graph,
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "tiny", TinySpec(dtype="float32", dspark=True))
        for batch in args.batch:
            off = decode_rate(path, batch, args.new, None, server)
            rows.append({"batch": batch, "accept": "off", **off, "speedup": 1.0, "ideal": 1.0})
            for accept in args.accept:
                on = decode_rate(path, batch, args.new, accept, server)
                relative_cost = on["step_s"] / off["step_s"]
                rows.append(
                    {
                        "batch": batch,
                        "accept": accept,
                        **on,
                        "relative_step_cost": relative_cost,
                        "speedup": on["tok_s_per_request"] / off["tok_s_per_request"],
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
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
