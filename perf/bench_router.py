"""MoE router (Triton `route`) on the GPU: µs per call vs the torch reference and the weight's
read floor.

Real shapes: E 128 experts, H 6144, top-4, routed scaling 2.0, fp32 router weight (3 MB), bf16
activations, at T in (1, 8, 32, 64, 128, 2048) tokens. Both the kernel and the torch reference
(`m3serve.kernels.moe.route_topk`: an fp32 matmul, not TF32, then sigmoid, topk, gather and
renormalization; its timing leaves out the routed-scaling multiply the kernel folds in) are
timed as CUDA-graph replays, the engine's decode mode, in the same run:

* cold: replays rotate through enough (weight, bias, x) sets that each call finds its weight out
  of L2 (50 MB on H200), as in the model, where 57 MoE layers' routers do not fit L2 together;
* hot: one set replayed, the weight L2-resident.

The floor is the 3 MB weight read once at the device's read bandwidth, measured in the same run
(a Triton kernel that only reads 4 GiB); an empty kernel's launch cost in a graph is printed
alongside, since at decode sizes a call is latency-bound (the split path is two launches, the
second one overlapped by programmatic dependent launch on sm_90). At 2048 tokens the fp32
FMA work (2·T·E·H flops) dominates instead: the table gives the achieved TFLOP/s. Every point
first checks the kernel picks the reference's experts (the fraction of tokens with the same set,
which can fall short of 1 only through near-ties).

    python perf/bench_router.py [--tokens 1,8,32,64,128,2048] [--sweep] [--out PATH]

Up to 8 tokens the router takes its GEMV route (one launch); the `tile` column is the two-kernel
tile route at the same T (the decode path before it).
--sweep also times a grid of (splits, expert blocks, warps) launches at each T, to guide the
heuristic (the 6 fastest, and the heuristic's own against the best).
Prints a table; writes JSON to $OUT/bench_router.json when $OUT is set, else to
perf/results/bench_router.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from gpu_timing import graph_us, launch_us, read_bandwidth
from result_json import write_result

from m3serve.kernels.moe import route_topk
from m3serve.kernels.triton.router import RoutePlan, route, route_plan

E, H, K, SCALE = 128, 6144, 4, 2.0
L2_BYTES = 50 * 2**20
MAX_SETS = 32
SWEEP_SPLITS = (1, 4, 8, 16, 32, 64)
SWEEP_BLOCKS = (1, 2, 4, 8)
SWEEP_WARPS = (4, 8)


# --------------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class RouterSet:
    weight: torch.Tensor  # [E, H] fp32
    bias: torch.Tensor  # [E] fp32
    x: torch.Tensor  # [T, H] bf16


def make_sets(tokens: int, count: int, seed: int) -> list[RouterSet]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    return [
        RouterSet(randn(E, H) * H**-0.5, randn(E) * 0.1, randn(tokens, H).bfloat16())
        for _ in range(count)
    ]


def set_bytes(tokens: int) -> int:
    return E * H * 4 + E * 4 + tokens * H * 2 + tokens * K * (4 + 8)


def cold_sets(tokens: int) -> int:
    """Sets to rotate through so that a set's weight has left L2 by its next call."""
    return max(1, min(MAX_SETS, -(-3 * L2_BYTES // set_bytes(tokens))))


def same_experts(s: RouterSet) -> float:
    """Fraction of tokens whose kernel set of experts equals the reference's."""
    _, ids = route(s.x, s.weight, s.bias, K, SCALE)
    _, ref = route_topk(s.x, s.weight, s.bias, K)
    return (ids.sort(1).values == ref.sort(1).values).all(1).float().mean().item()


def kernel_calls(sets: list[RouterSet], **launch: int) -> list[Callable[[], object]]:
    return [lambda s=s: route(s.x, s.weight, s.bias, K, SCALE, **launch) for s in sets]


def torch_calls(sets: list[RouterSet]) -> list[Callable[[], object]]:
    return [lambda s=s: route_topk(s.x, s.weight, s.bias, K) for s in sets]


def plan_name(plan: RoutePlan) -> str:
    if plan.gemv:
        return f"gemv bt{plan.block_t}"
    if plan.fused:
        return f"fused bt{plan.block_t}"
    return f"bt{plan.block_t} e{plan.expert_blocks} s{plan.splits}"


def tile_plan(tokens: int) -> RoutePlan:
    """The tile route's own plan at this T (a given block_t takes it, as above GEMV_MAX_TOKENS)."""
    return route_plan(
        tokens, E, H, torch.device("cuda"), block_t=max(16, 1 << (tokens - 1).bit_length())
    )


# --------------------------------------------------------------------------------- points


def point(tokens: int, read_bw: float) -> dict[str, float | int | str]:
    sets = make_sets(tokens, cold_sets(tokens), seed=tokens)
    plan = route_plan(tokens, E, H, torch.device("cuda"))
    row: dict[str, float | int | str] = {"tokens": tokens, "sets": len(sets)}
    row.update({f"plan_{k}": v for k, v in dataclasses.asdict(plan).items()})
    row["same_experts"] = same_experts(sets[0])
    row["triton_us"] = graph_us(kernel_calls(sets))
    row["triton_hot_us"] = graph_us(kernel_calls(sets[:1]))
    row["torch_us"] = graph_us(torch_calls(sets))
    row["torch_hot_us"] = graph_us(torch_calls(sets[:1]))
    row["speedup"] = row["torch_us"] / row["triton_us"]
    if plan.gemv:  # what the tile route (the two-kernel split) takes at the same T
        tile = tile_plan(tokens)
        launch = {
            "block_t": tile.block_t,
            "splits": tile.splits,
            "expert_blocks": tile.expert_blocks,
        }
        row["tile_route_us"] = graph_us(kernel_calls(sets, **launch))
    row["weight_floor_us"] = E * H * 4 / read_bw * 1e6
    row["io_floor_us"] = set_bytes(tokens) / read_bw * 1e6  # weight + x + outputs
    row["floor_fraction"] = row["weight_floor_us"] / row["triton_us"]
    row["tflops"] = 2 * tokens * E * H / row["triton_us"] / 1e6
    return row


def sweep_point(tokens: int) -> list[dict[str, float | int]]:
    """Cold µs of each (splits, expert blocks, stage-1 warps) at this T (splits are rounded to
    whole BLOCK_K steps, so some requests land on the same plan: timed once)."""
    sets = make_sets(tokens, cold_sets(tokens), seed=tokens + 1)
    own = route_plan(tokens, E, H, torch.device("cuda"))
    grid = [(s, b) for s in SWEEP_SPLITS for b in SWEEP_BLOCKS]
    seen: set[RoutePlan] = set()
    rows = []
    # The GEMV route has no splits or blocks: the sweep times the tile route's plans beside it.
    own = own if not own.gemv else tile_plan(tokens)
    for splits, blocks in [(own.splits, own.expert_blocks), *grid]:
        plan = route_plan(tokens, E, H, torch.device("cuda"), splits=splits, expert_blocks=blocks)
        if plan in seen:
            continue
        seen.add(plan)
        for warps in SWEEP_WARPS:
            launch = {"splits": splits, "expert_blocks": blocks, "num_warps": warps}
            us = graph_us(kernel_calls(sets, **launch), 20.0)
            rows.append(
                {"tokens": tokens, **dataclasses.asdict(plan), "num_warps": warps, "us": us}
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,64,128,2048")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    # The reference's fp32 matmul as the engine runs it: IEEE fp32, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False

    read_bw = read_bandwidth()
    launch = launch_us()
    print(
        f"read bandwidth {read_bw / 1e12:.2f} TB/s: 3 MB weight floor "
        f"{E * H * 4 / read_bw * 1e6:.2f} µs; empty-kernel launch in a graph {launch:.2f} µs"
    )
    print(f"\nrouter E={E} H={H} top-{K}, bf16 x, fp32 weight; CUDA-graph µs per call")
    print(
        f"{'T':>5} {'plan':>16} {'triton':>8} {'hot':>7} {'torch':>8} {'hot':>7} {'×torch':>7} "
        f"{'floor':>6} {'%floor':>6} {'TFLOP/s':>8} {'same':>6} {'tile':>7}"
    )
    rows = []
    for t in tokens:
        r = point(t, read_bw)
        rows.append(r)
        plan = route_plan(t, E, H, torch.device("cuda"))
        print(
            f"{t:>5} {plan_name(plan):>16} {r['triton_us']:>8.2f} {r['triton_hot_us']:>7.2f} "
            f"{r['torch_us']:>8.2f} {r['torch_hot_us']:>7.2f} {r['speedup']:>7.2f} "
            f"{r['weight_floor_us']:>6.2f} {100 * r['floor_fraction']:>5.1f}% "
            f"{r['tflops']:>8.2f} {r['same_experts']:>6.4f} {r.get('tile_route_us', 0.0):>7.2f}"
        )

    sweep = []
    if args.sweep:
        print("\nsweep (cold µs; e = expert blocks, s = splits, w = warps, * = the heuristic)")
        for t in tokens:
            pts = sweep_point(t)
            sweep.extend(pts)
            plan = route_plan(t, E, H, torch.device("cuda"))
            chosen = {**dataclasses.asdict(plan), "num_warps": plan.num_warps}
            cells = []
            for p in sorted(pts, key=lambda p: p["us"])[:6]:
                mark = "*" if all(p[k] == v for k, v in chosen.items()) else " "
                name = f"e{p['expert_blocks']}s{p['splits']}w{p['num_warps']}{mark}"
                cells.append(f"{name} {p['us']:.2f}")
            best = min(pts, key=lambda p: p["us"])["us"]
            mine = [p["us"] for p in pts if all(p[k] == v for k, v in chosen.items())]
            cells.append(f"| heuristic {mine[0]:.2f} ({mine[0] / best:.2f}x best)")
            print(f"  T={t:<5} " + "  ".join(cells))

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "read_bandwidth_bytes_per_s": read_bw,
        "empty_kernel_launch_us": launch,
        "shape": {"experts": E, "hidden": H, "top_k": K, "scale": SCALE},
        "points": rows,
        "sweep": sweep,
    }
    write_result(result, "bench_router.json", args.out)


if __name__ == "__main__":
    main()
