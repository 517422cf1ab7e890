"""The M3.1 vision encoder (ViT tower + patch-merge projector, model/vision/) at the real sizes:
time per image against the compute floor, on this machine's device.

Random weights at the real widths (32 layers x 1280, 16 heads, MLP 5120; projector 1280 ->
6144, merge 24576 -> 6144 -> 6144): time does not depend on the values. One square image per
call; a side of S pixels is (S/14)^2 patches and (S/28)^2 LLM tokens, so 672 px is the 576-token
image of the default processor limits. The floor is the encoder's matmul FLOPs (attention
included) over the bf16 matmul rate measured in the same run (a large square matmul), so
`of floor` is the fraction of that rate the encoder reaches.

    python perf/bench_vision.py [--sides 336 672 1008] [--device cuda|cpu] [--layers 32]

CPU: the reference backend in fp32 (the matmul rate is measured in fp32 too); CUDA: the hopper
backend in bf16. Prints a table; writes JSON to $OUT/bench_vision.json when $OUT is set, else
perf/results/bench_vision_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from m3serve.backends import auto_backend, create_backend
from m3serve.model.vision.config import VisionConfig
from m3serve.model.vision.encoder import VisionEncoder


def encoder_flops(cfg: VisionConfig, patches: int, attention: bool = True) -> float:
    """Multiply-adds x 2 of one image's forward: every projection, the attention matmuls (one
    segment: every patch attends to every patch; left out with `attention=False`), the
    per-patch projector (hidden -> mid -> text) and the 2x2 merge MLP (4 text -> mid -> text)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    mid, text, tokens = cfg.projector_hidden_size, cfg.text_hidden_size, patches // cfg.merge
    layer = patches * (4 * h * h + 2 * h * f) + attention * 2 * patches * patches * h
    projector = patches * (h * mid + mid * text) + tokens * (cfg.merge * text * mid + mid * text)
    return 2.0 * (patches * cfg.patch_dim * h + cfg.num_layers * layer + projector)


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall ms of `fn` over `reps` runs after one untimed run (allocations, autotuning)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, reps: int) -> float:
    """The device's dense matmul rate at this dtype, measured now: the floor's denominator."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / (timed_ms(lambda: a @ b, device, reps) * 1e-3) / 1e12


def random_encoder(cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    backend = create_backend(auto_backend(device), device)
    encoder = VisionEncoder(cfg, backend, dtype=dtype, device=device)
    with torch.no_grad():
        for param in encoder.parameters():
            param.normal_(0.0, 0.02)
    return encoder


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = replace(VisionConfig(), num_layers=args.layers)
    encoder = random_encoder(cfg, device, dtype)
    reps = args.reps or (20 if device.type == "cuda" else 1)
    rate = matmul_tflops(device, dtype, reps)
    rows = []
    for side in args.sides:
        grid = (1, side // cfg.patch_size, side // cfg.patch_size)
        patches = grid[1] * grid[2]
        pixels = torch.randn(patches, cfg.patch_dim, device=device)
        ms = timed_ms(lambda p=pixels, g=grid: encoder.encode(p, [g]), device, reps)
        flops = encoder_flops(cfg, patches)
        floor_ms = flops / (rate * 1e12) * 1e3
        rows.append(
            {
                "side_px": side,
                "patches": patches,
                "tokens": patches // cfg.merge,
                "us_per_image": ms * 1e3,
                "gflop": flops / 1e9,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "floor_us": floor_ms * 1e3,
                "of_floor": floor_ms / ms,
            }
        )
    return {
        "benchmark": "bench_vision",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "layers": cfg.num_layers,
        "reps": reps,
        "matmul_tflops": rate,
        "rows": rows,
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"vision encoder, {report['layers']} layers, {report['dtype']} on {report['device']} "
        f"(matmul rate measured: {report['matmul_tflops']:.1f} TFLOP/s)"
    )
    columns = ("side px", 8), ("tokens", 7), ("µs/image", 11), ("TFLOP/s", 8), ("floor µs", 10)
    print(" ".join(f"{name:>{width}}" for name, width in columns), f"{'of floor':>8}")
    for r in report["rows"]:
        print(
            f"{r['side_px']:>8} {r['tokens']:>7} {r['us_per_image']:>11.0f} {r['tflops']:>8.1f} "
            f"{r['floor_us']:>10.0f} {r['of_floor']:>8.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[336, 672, 1008])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=0, help="timed runs (0: 20 on CUDA, 1 CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = run(args)
    print_table(report)
    out = args.out or (
        Path(os.environ["OUT"]) / "bench_vision.json"
        if "OUT" in os.environ
        else Path(__file__).parent / "results" / f"bench_vision_{args.device}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
