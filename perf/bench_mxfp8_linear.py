"""W8A16 MXFP8 linear (Triton) on the GPU: decode time vs the read-bandwidth floor, prefill
TFLOP/s vs torch's bf16 matmul.

Shapes (N, K) are the model's MXFP8 projections: fused q/k/v/index-q/index-k (9856, 6144), o_proj
(6144, 8192), shared-expert down (6144, 3072), shared gate_up (6144, 6144), dense gate_up
(24576, 6144), dense down (6144, 12288).

* decode, M in {1, 8, 32, 64, 128}: `mxfp8_linear` replayed from a CUDA graph (the engine's decode
  mode). Achieved bandwidth counts the weight bytes (codes + scales) once per call, against the
  read-only bandwidth of a streaming Triton kernel measured in the same run; activations and
  outputs (< 2 % of the bytes at M 64) are left out of the count. The replays rotate through
  enough copies of the weight to overflow L2 (50 MB on H200) between visits, as the model's
  layers do. Also timed: torch's bf16 matmul on the dequantized weight (twice the bytes), the
  alternative of dequantizing at load.
* prefill, M 2048: both timed the same way (graph replay), TFLOP/s = 2 M N K / time.
* the two decode kernels side by side at M <= 8 (`gemv_us`, `mma_us`: each forced, whatever
  `plan_mxfp8` picks), the measurement behind `GEMV_MAX_M`; `--gemv-sweep` times the GEMV
  kernel's tile choices at M 1 and 2 on each shape, `--decode-sweep` the MMA path's
  (`DECODE_SWEEP`: rows, stages, warps, programs per SM before K is split; at K steps of 128
  each with its scales loaded as bytes and as a word a row) at M 4-64 (`--sweep-ms`), the
  measurement behind `_DECODE_TILES`.
* the MMA tiles against the dequantized path (W to bf16, then cuBLAS), each forced, at the
  `--crossover-ms` sizes: the measurement behind `DEQUANT_MIN_M`.
* `--mid-sweep`: at the `--mid-ms` sizes past one decode tile (a mixed step's rows: 16-64 decode
  rows plus a prompt chunk of up to a few hundred tokens), the served plan, each `MID_SWEEP`
  tile and the dequantized path, each forced; per M the fastest; and the dequantized path on a
  bf16 W held beside the codes (`--mxfp8-bf16-copy`).

    python perf/bench_mxfp8_linear.py [--ms 1,8,32,64,128] [--prefill-m 2048]
        [--crossover-ms 64,96,128,...] [--shapes qkv_index,o_proj,...] [--gemv-sweep]
        [--decode-sweep [--sweep-ms 4,8,16,32,64]] [--mid-sweep [--mid-ms 80,96,...]]
        [--out PATH]

(`--ms '' --prefill-m 0 --crossover-ms ''` leaves only the sweeps.)

Timing and the bandwidth measurement come from perf/gpu_timing.py (run the script by path, so
that perf/ is on sys.path).

Prints a table; writes JSON to $OUT/bench_mxfp8_linear.json when $OUT is set, else to
perf/results/bench_mxfp8_linear.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from gpu_timing import graph_us, read_bandwidth
from result_json import write_result

from m3serve.kernels.quant import dequant_mxfp8, quant_mxfp8
from m3serve.kernels.triton.mxfp8_linear import Mxfp8Plan, mxfp8_linear, plan_mxfp8, split_for

SHAPES = {
    "qkv_index": (9856, 6144),
    "o_proj": (6144, 8192),
    "shared_down": (6144, 3072),
    "shared_gate_up": (6144, 6144),
    "dense_gate_up": (24576, 6144),
    "dense_down": (6144, 12288),
}
L2_BYTES = 50 * 2**20


# ------------------------------------------------------------------------------ benchmark


class Weight:
    """`copies` MXFP8 copies of one random [n, k] weight (distinct addresses, so rotating
    through them misses L2) and the bf16 dequantized weight for torch's matmul."""

    def __init__(self, n: int, k: int, copies: int, bf16_copies: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        codes, scales = quant_mxfp8(w)
        del w
        self.codes = [codes] + [codes.clone() for _ in range(copies - 1)]
        self.scales = [scales] + [scales.clone() for _ in range(copies - 1)]
        dense = dequant_mxfp8(codes, scales).to(torch.bfloat16)
        self.dense = [dense] + [dense.clone() for _ in range(bf16_copies - 1)]
        self.bytes = codes.numel() + scales.numel()


def copies_for(nbytes: int) -> int:
    return max(1, min(16, -(-3 * L2_BYTES // nbytes)))


def point(
    name: str, weight: Weight, m: int, bandwidth: float, kind: str
) -> dict[str, float | int | str]:
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in weight.codes]
    dense_outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in weight.dense]

    def ours(i: int, plan: Mxfp8Plan | None = None) -> Callable[[], object]:
        return lambda: mxfp8_linear(x, weight.codes[i], weight.scales[i], out=outs[i], plan=plan)

    def torch_bf16(i: int) -> Callable[[], object]:
        return lambda: torch.mm(x, weight.dense[i].t(), out=dense_outs[i])

    plan = plan_mxfp8(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    row: dict[str, float | int | str] = {"shape": name, "n": n, "k": k, "m": m, "kind": kind}
    row.update(block_m=plan.block_m, block_n=plan.block_n, block_k=plan.block_k)
    row["split_k"] = plan.split_k
    row["us"] = graph_us([ours(i) for i in range(len(outs))])
    if m <= 8:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for path, limit in (("gemv", 16), ("mma", 0)):
            forced = plan_mxfp8(m, n, k, sms, gemv_max_m=limit)
            row[f"{path}_us"] = graph_us([ours(i, forced) for i in range(len(outs))])
    row["torch_bf16_us"] = graph_us([torch_bf16(i) for i in range(len(dense_outs))])
    row["weight_bytes"] = weight.bytes
    row["gb_per_s"] = weight.bytes / row["us"] / 1e3
    row["read_fraction"] = weight.bytes / (row["us"] * 1e-6) / bandwidth
    flops = 2 * m * n * k
    row["tflops"] = flops / row["us"] / 1e6
    row["torch_bf16_tflops"] = flops / row["torch_bf16_us"] / 1e6
    row["speedup_vs_torch_bf16"] = row["torch_bf16_us"] / row["us"]
    # Sanity: both timed calls compute the same product (bf16 rounding apart).
    ours(0)()
    torch_bf16(0)()
    ref = dense_outs[0].float()
    row["rel_diff_vs_torch"] = float((outs[0].float() - ref).norm() / ref.norm())
    return row


def sweep_weight(name: str, bf16_reads: bool = False) -> tuple[int, int, Weight, int]:
    """(N, K, the shape's weight copies, the SM count) for a sweep on one shape; its
    dequantized W in enough copies to miss L2 only where the sweep reads them (`bf16_reads`)."""
    n, k = SHAPES[name]
    weight = Weight(n, k, copies_for(n * k * 33 // 32), copies_for(2 * n * k) if bf16_reads else 1)
    return n, k, weight, torch.cuda.get_device_properties(0).multi_processor_count


def operands(m: int, weight: Weight) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random bf16 activations of `m` rows and an output per weight copy."""
    n, k = weight.codes[0].shape
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    return x, [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in weight.codes]


def gemv_sweep(name: str, bandwidth: float) -> list[dict[str, float | int | str]]:
    """The GEMV kernel's tile choices on one shape at M 1 and 2 (graph replay). Narrow row
    tiles are in the grid because the programs' count against the SMs' slots matters: the
    model's N = 6144 projections give 768 programs of 8 rows."""
    n, k, weight, _ = sweep_weight(name)
    rows: list[dict[str, float | int | str]] = []
    print(f"\nGEMV tiles on {name} ({n} x {k}): µs (% of read bandwidth)")
    for m in (1, 2):
        x, outs = operands(m, weight)
        for block_n, block_k, warps, stages in itertools.product((4, 8, 16), (512, 1024), (4, 8),
                                                                 (3, 4)):  # fmt: skip
            plan = Mxfp8Plan(m, block_n, block_k, 1, warps, stages, gemv=True)
            us = graph_us(_calls(x, weight, outs, plan))
            frac = weight.bytes / (us * 1e-6) / bandwidth
            rows.append(
                {"shape": name, "m": m, "block_n": block_n, "block_k": block_k, "warps": warps,
                 "stages": stages, "us": us, "read_fraction": frac}
            )  # fmt: skip
            tiles = f"n{block_n} k{block_k} w{warps} s{stages}"
            print(f"  M {m} {tiles}: {us:7.2f} ({100 * frac:4.1f}%)")
    return rows


# MMA decode tiles the sweep times: (BLOCK_N, BLOCK_K, warps, stages, programs per SM below which
# K is split).
DECODE_SWEEP = (
    (64, 128, 4, 4, 2),
    (64, 128, 4, 4, 4),
    (128, 128, 4, 4, 2),
    (128, 128, 4, 3, 2),
    (128, 128, 8, 4, 2),
    (64, 256, 4, 3, 2),
    (128, 256, 4, 3, 2),
    (128, 128, 4, 4, 1),
    # The served M-tile-64 tiles spill 816 bytes a thread at 4 warps (perf/sm90_resources.py);
    # at 8 warps they do not.
    (128, 128, 8, 4, 1),
)
DECODE_SWEEP_MS = (4, 8, 16, 32, 64)


def decode_sweep(
    name: str, bandwidth: float, ms: tuple[int, ...] = DECODE_SWEEP_MS
) -> list[dict[str, float | int | str]]:
    """The MMA decode tiles of `DECODE_SWEEP` on one shape at each of `ms` (graph replay)."""
    n, k, weight, sms = sweep_weight(name)
    rows: list[dict[str, float | int | str]] = []
    print(f"\nMMA decode tiles on {name} ({n} x {k}): µs (% of read bandwidth)")
    for m in ms:
        x, outs = operands(m, weight)
        for plan in _sweep_plans(m, n, k, sms):
            us = graph_us(_calls(x, weight, outs, plan))
            frac = weight.bytes / (us * 1e-6) / bandwidth
            served = plan_mxfp8(m, n, k, sms) == plan
            rows.append(
                {"shape": name, "m": m, "block_n": plan.block_n, "block_k": plan.block_k,
                 "warps": plan.num_warps, "stages": plan.num_stages, "split_k": plan.split_k,
                 "scale_words": plan.scale_words, "us": us, "read_fraction": frac,
                 "served": served}
            )  # fmt: skip
            tiles_text = (
                f"n{plan.block_n} k{plan.block_k} w{plan.num_warps} s{plan.num_stages} "
                f"split {plan.split_k}{' words' if plan.scale_words else ''}"
            )
            mark = "  (served)" if served else ""
            print(f"  M {m:2d} {tiles_text:>32}: {us:7.2f} ({100 * frac:4.1f}%){mark}")
    return rows


def _sweep_plans(m: int, n: int, k: int, sms: int) -> list[Mxfp8Plan]:
    """Each `DECODE_SWEEP` tile as the plan makes it, and at K steps of 128 with the other
    scale load too (words or bytes: perf/sm90_resources.py counts their loops)."""
    plans = []
    for tiles in DECODE_SWEEP:
        plan = plan_mxfp8(m, n, k, sms, decode_tiles=tiles)
        plans.append(plan)
        if plan.block_k == 128:
            plans.append(dataclasses.replace(plan, scale_words=not plan.scale_words))
    return plans


# Tiles the mid sweep times: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM below
# which K is split, scales as one word a row).
MID_SWEEP = (
    (128, 128, 64, 8, 3, 1, False),  # the prefill tile before 2026-12-06
    (128, 128, 64, 8, 4, 1, False),
    (128, 128, 128, 8, 3, 1, True),  # the served prefill tile
    (128, 64, 128, 4, 4, 2, True),
    (128, 64, 128, 8, 4, 1, True),
    (64, 64, 128, 4, 4, 2, True),  # the served decode tile at M 64, over several M tiles
    (64, 128, 128, 8, 3, 1, True),
    (64, 128, 64, 4, 4, 2, False),
    # 256 rows a program: each weight tile is dequantized in registers once per 256 rows, not
    # per 128 (the 128-row tile's time grows with its M tiles: the conversion bounds it). On an
    # H100 (2026-12-06) they lost to the dequantized path at every M from 160 to 512.
    (256, 64, 128, 4, 2, 1, True),
    (256, 64, 128, 8, 3, 1, True),
    (256, 128, 64, 8, 3, 1, False),
    (256, 128, 128, 8, 2, 1, True),
)
MID_SWEEP_MS = (80, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def mid_sweep(name: str, ms: tuple[int, ...]) -> list[dict[str, float | int | str]]:
    """The served plan, each `MID_SWEEP` tile and the dequantized path at each of `ms`."""
    n, k, weight, sms = sweep_weight(name, bf16_reads=True)
    rows: list[dict[str, float | int | str]] = []
    print(f"\nmid-M tiles on {name} ({n} x {k}): µs")
    for m in ms:
        x, outs = operands(m, weight)
        plans = {"served": plan_mxfp8(m, n, k, sms)}
        plans["dequant"] = plan_mxfp8(m, n, k, sms, dequant_min_m=0)
        for bm, bn, bk, warps, stages, per_sm, words in MID_SWEEP:
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            split = split_for(tiles, triton.cdiv(k, bk), per_sm * sms)
            label = f"m{bm} n{bn} k{bk} w{warps} s{stages} p{per_sm}{' words' if words else ''}"
            plans[label] = Mxfp8Plan(bm, bn, bk, split, warps, stages, scale_words=words)
        reference = mxfp8_linear(x, weight.codes[0], weight.scales[0], plan=plans["dequant"])
        timed: dict[str, float] = {}
        for label, plan in plans.items():
            try:
                got = mxfp8_linear(x, weight.codes[0], weight.scales[0], plan=plan)
                diff = float((got.float() - reference.float()).norm() / reference.float().norm())
                if diff > 1e-2:
                    raise ValueError(f"relative difference {diff:.2e} from the dequantized path")
                timed[label] = graph_us(_calls(x, weight, outs, plan))
            except Exception as err:  # e.g. a tile past the SM's shared memory: not a choice
                print(f"  M {m:4d} {label}: {type(err).__name__}: {str(err)[:80]}")
                timed[label] = float("inf")
        best = min(timed, key=timed.__getitem__)
        # `--mxfp8-bf16-copy`: the dequantized path on a bf16 W held beside the codes.
        held = _calls(x, weight, outs, plans["dequant"], weight.dense)
        held[0]()
        if not torch.equal(outs[0], reference):  # W is exact in bf16: the same bits expected
            print(f"  M {m:4d} bf16 copy: output differs from the per-call dequantization")
        timed["bf16 copy"] = graph_us(held)
        rows += [{"shape": name, "m": m, "plan": label, "us": us} for label, us in timed.items()]
        print(
            f"  M {m:4d} served {timed['served']:7.1f}  dequant {timed['dequant']:7.1f}  "
            f"best {timed[best]:7.1f} ({best})  bf16 copy {timed['bf16 copy']:7.1f}"
        )
    return rows


def crossover(name: str, weight: Weight, ms: list[int]) -> list[dict[str, float | int | str]]:
    """The MMA tiles and the dequantized path, each forced, at each M (graph replay)."""
    n, k = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, float | int | str]] = []
    for m in ms:
        x, outs = operands(m, weight)
        mma = plan_mxfp8(m, n, k, sms, dequant_min_m=1 << 30)
        dq = plan_mxfp8(m, n, k, sms, dequant_min_m=0)
        mma_us = graph_us(_calls(x, weight, outs, mma))
        dq_us = graph_us(_calls(x, weight, outs, dq))
        rows.append(
            {"shape": name, "m": m, "mma_us": mma_us, "dequant_us": dq_us,
             "mma_tflops": 2 * m * n * k / mma_us / 1e6,
             "dequant_tflops": 2 * m * n * k / dq_us / 1e6}
        )  # fmt: skip
    return rows


def _calls(
    x: torch.Tensor,
    weight: Weight,
    outs: list[torch.Tensor],
    plan: Mxfp8Plan,
    bf16: list[torch.Tensor] | None = None,
) -> list[Callable[[], object]]:
    """One call per weight copy; `bf16`: W's bf16 copies held beside the codes, in turn."""

    def call(i: int) -> Callable[[], object]:
        held = bf16[i % len(bf16)] if bf16 else None
        codes, scales = weight.codes[i], weight.scales[i]
        return lambda: mxfp8_linear(x, codes, scales, out=outs[i], plan=plan, bf16=held)

    return [call(i) for i in range(len(outs))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,8,32,64,128")
    parser.add_argument("--prefill-m", type=int, default=2048)
    parser.add_argument("--crossover-ms", default="64,96,128,160,192,256,384,512,1024,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemv-sweep", action="store_true")
    parser.add_argument("--decode-sweep", action="store_true")
    parser.add_argument("--sweep-ms", default=",".join(map(str, DECODE_SWEEP_MS)))
    parser.add_argument("--mid-sweep", action="store_true")
    parser.add_argument("--mid-ms", default=",".join(map(str, MID_SWEEP_MS)))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",") if m]
    cross_ms = [int(m) for m in args.crossover_ms.split(",") if m]
    shapes = args.shapes.split(",")

    bandwidth = read_bandwidth()
    print(f"device read-only bandwidth: {bandwidth / 1e12:.2f} TB/s")

    decode, prefill, cross = [], [], []
    sweep = [r for name in shapes for r in gemv_sweep(name, bandwidth)] if args.gemv_sweep else []
    tiles = []
    if args.decode_sweep:
        sweep_ms = tuple(int(m) for m in args.sweep_ms.split(","))
        tiles = [r for name in shapes for r in decode_sweep(name, bandwidth, sweep_ms)]
    mids = []
    if args.mid_sweep:
        mid_ms = tuple(int(m) for m in args.mid_ms.split(","))
        mids = [r for name in shapes for r in mid_sweep(name, mid_ms)]
    print("\ndecode (CUDA-graph replay; GB/s of weight bytes = codes + scales)")
    print(
        f"{'shape':>15} {'N':>6} {'K':>6} {'M':>4} {'bm':>4} {'split':>5} {'µs':>8} {'GB/s':>7} "
        f"{'%read':>6} {'bf16 µs':>8} {'×bf16':>6} {'rel diff':>9}"
    )
    for name in shapes:
        n, k = SHAPES[name]
        weight = Weight(n, k, copies_for(n * k * 33 // 32), copies_for(2 * n * k))
        for m in ms:
            r = point(name, weight, m, bandwidth, "decode")
            decode.append(r)
            print(
                f"{name:>15} {r['n']:>6} {r['k']:>6} {m:>4} {r['block_m']:>4} {r['split_k']:>5} "
                f"{r['us']:>8.2f} {r['gb_per_s']:>7.0f} {100 * r['read_fraction']:>5.1f}% "
                f"{r['torch_bf16_us']:>8.2f} {r['speedup_vs_torch_bf16']:>6.2f} "
                f"{r['rel_diff_vs_torch']:>9.2e}"
                + (f"  gemv {r['gemv_us']:.2f} / mma {r['mma_us']:.2f} µs" if m <= 8 else "")
            )

        # Prefill now, while this shape's weights exist: one shape's copies in memory at a time.
        if args.prefill_m > 0:
            prefill.append(point(name, weight, args.prefill_m, bandwidth, "prefill"))
        cross += crossover(name, weight, cross_ms)
        del weight
        torch.cuda.empty_cache()

    print(f"\nprefill M = {args.prefill_m} (CUDA-graph replay)")
    print(
        f"{'shape':>15} {'N':>6} {'K':>6} {'µs':>9} {'TFLOP/s':>8} {'bf16 µs':>9} "
        f"{'bf16 TFLOP/s':>12} {'vs bf16':>7} {'rel diff':>9}"
    )
    for r in prefill:
        name = r["shape"]
        print(
            f"{name:>15} {r['n']:>6} {r['k']:>6} {r['us']:>9.1f} {r['tflops']:>8.1f} "
            f"{r['torch_bf16_us']:>9.1f} {r['torch_bf16_tflops']:>12.1f} "
            f"{100 * r['speedup_vs_torch_bf16']:>6.0f}% {r['rel_diff_vs_torch']:>9.2e}"
        )

    print("\nMMA tiles vs dequantized + cuBLAS, each forced (CUDA-graph replay)")
    print(f"{'shape':>15} {'M':>5} {'mma µs':>9} {'dequant µs':>11} {'ratio':>7}  faster")
    for r in cross:
        print(
            f"{r['shape']:>15} {r['m']:>5} {r['mma_us']:>9.1f} {r['dequant_us']:>11.1f} "
            f"{r['mma_us'] / r['dequant_us']:>7.2f}  "
            f"{'dequant' if r['dequant_us'] < r['mma_us'] else 'mma'}"
        )

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "read_bandwidth_bytes_per_s": bandwidth,
        "decode": decode,
        "prefill": prefill,
        "gemv_sweep": sweep,
        "decode_sweep": tiles,
        "mid_sweep": mids,
        "crossover": cross,
    }
    write_result(result, "bench_mxfp8_linear.json", args.out)


if __name__ == "__main__":
    main()
