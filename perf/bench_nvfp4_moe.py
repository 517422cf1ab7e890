"""NVFP4 routed experts (Triton W4A16, m3serve.kernels.triton.nvfp4_moe) on the GPU: decode
bandwidth and prefill throughput at the real shapes (E 128, H 6144, I 3072, top-4).

Random valid NVFP4 weights (uniform codes, e4m3 group scales, per-half globals), unit-RMS bf16
activations, top-4 of uniform random scores per token.

* Decode, T in {1, 2, 4, 8, 16, 32, 64, 128}, timed as CUDA-graph replay (the engine's decode
  mode) rotating over several routings so experts are not found in L2 (50 MB; one expert is
  31.8 MB). Bytes = distinct selected experts x (packed weights + group scales) of both
  projections, i.e. what must cross HBM; GB/s and the fraction of the read-only bandwidth
  measured in the same run (a Triton kernel that only reads; target >= 70% at T 1-32).
* Prefill, T = 2048 (8192 pairs, the sorted route): TFLOP/s of the useful work
  2 * pairs * (2I*H + H*I), against a bf16 torch matmul doing the same work in two dense GEMMs
  (M = pairs) measured in the same run (target >= 50%).
* The same T through today's bf16 path, `moe_experts_grouped` (torch._grouped_mm) on the
  weights dequantized to bf16 once (14.5 GB), for comparison; its output is also the sanity
  check (relative difference of the two, both on identical weight values).

    python perf/bench_nvfp4_moe.py [--tokens 1,2,4,8,16,32,64,128] [--prefill 2048[,T...]]
        [--experts 128] [--ablations [--ablation-tokens 1,8,32] | --prefill-ablations]
        [--variants NAME,...] [--out PATH]

`--ablations` adds, at T in {1, 8, 32} (`--ablation-tokens`): the plain-Triton decode (no
inline PTX), the other route, no PDL, a few tile/stage/warp variants and K splits (`ABLATIONS`);
and tile variants of the prefill (`PREFILL_ABLATIONS`), to guide tuning of `_plan`;
`--variants` names the ones to run. `--prefill-ablations`: only the prefill's, at each
`--prefill` T. `--experts N` routes over N experts instead of the model's 128 (the 4-layer
serving slice has 8: its mixed steps of 300-600 tokens give 150-300 pairs an expert, a regime
the real model's prefill reaches only at 5-10K tokens a step); `--tokens ''` skips the decode.
Prints a table; writes JSON to $OUT/bench_nvfp4_moe.json when $OUT is set, else to
perf/results/bench_nvfp4_moe.json (or --out).
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

from m3serve.backends.hopper.moe import grouped_mm_available, moe_experts_grouped
from m3serve.kernels.nvfp4_tiles import tile_experts
from m3serve.kernels.quant import dequant_nvfp4
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig, nvfp4_moe

H, INTER, TOP_K = 6144, 3072, 4
EXPERTS = 128  # the model's routed experts (`--experts`)
ALPHA, LIMIT = 1.702, 7.0
DEV = torch.device("cuda")
SETS = 4  # routings rotated through in one graph
DECODE_TOKENS = "1,2,4,8,16,32,64,128"


@dataclasses.dataclass
class Experts:
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    tiled: tuple[torch.Tensor, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # What the kernel reads: the same values with their rows tiled (the backend's layout).
        w13, w13_scale, w2, w2_scale = tile_experts(
            self.w13, self.w13_scale, self.w2, self.w2_scale
        )
        self.tiled = (w13, w13_scale, self.w13_global, w2, w2_scale, self.w2_global)

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.tiled

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def bytes_per_expert(self) -> int:
        tensors = (self.w13, self.w13_scale, self.w2, self.w2_scale)
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def bf16(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same weights dequantized to bf16 (exact), [E, 2I, H] and [E, H, I]."""
        experts = self.num_experts
        w13 = torch.empty(experts, 2 * INTER, H, dtype=torch.bfloat16, device=DEV)
        w2 = torch.empty(experts, H, INTER, dtype=torch.bfloat16, device=DEV)
        for e in range(experts):
            gate = dequant_nvfp4(
                self.w13[e, :INTER], self.w13_scale[e, :INTER], self.w13_global[e, 0]
            )
            up = dequant_nvfp4(
                self.w13[e, INTER:], self.w13_scale[e, INTER:], self.w13_global[e, 1]
            )
            w13[e] = torch.cat([gate, up])
            w2[e] = dequant_nvfp4(self.w2[e], self.w2_scale[e], self.w2_global[e])
        return w13, w2


def random_experts(experts: int = EXPERTS, seed: int = 0) -> Experts:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def nvfp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, device=DEV)
        scale = torch.rand(experts, rows, cols // 16, generator=gen, device=DEV) * 1.75 + 0.25
        return codes.to(torch.uint8), scale.to(torch.float8_e4m3fn)

    w13, w13_scale = nvfp4(2 * INTER, H)
    w2, w2_scale = nvfp4(H, INTER)
    w13_global = (torch.rand(experts, 2, generator=gen, device=DEV) + 0.5) * torch.tensor(
        [0.012, 0.009], device=DEV
    )
    w2_global = (torch.rand(experts, generator=gen, device=DEV) + 0.5) * 0.002
    return Experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global)


@dataclasses.dataclass
class Step:
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor

    def distinct(self) -> int:
        return int(self.ids.unique().numel())


def steps(tokens: int, count: int, seed: int, experts: int) -> list[Step]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(tokens, H, generator=gen, device=DEV).to(torch.bfloat16)
        scores = torch.rand(tokens, experts, generator=gen, device=DEV)
        weights, ids = torch.topk(scores, TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True) * 2.0
        out.append(Step(x, weights.float(), ids.to(torch.int32)))
    return out


def moe_call(
    ex: Experts, step: Step, config: NVFP4MoEConfig | None = None
) -> Callable[[], torch.Tensor]:
    cfg = config or NVFP4MoEConfig()
    return lambda: nvfp4_moe(step.x, step.weights, step.ids, *ex.args(), ALPHA, LIMIT, config=cfg)


def grouped_call(w13: torch.Tensor, w2: torch.Tensor, step: Step) -> Callable[[], torch.Tensor]:
    return lambda: moe_experts_grouped(step.x, step.weights, step.ids, w13, w2, ALPHA, LIMIT)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def decode_point(
    ex: Experts, bf16: tuple[torch.Tensor, torch.Tensor] | None, tokens: int, read_bw: float
) -> dict[str, float | int]:
    group = steps(tokens, SETS, seed=tokens, experts=ex.num_experts)
    distinct = sum(s.distinct() for s in group) / len(group)
    nbytes = distinct * ex.bytes_per_expert()
    row: dict[str, float | int] = {"tokens": tokens, "pairs": tokens * TOP_K}
    row["distinct_experts"] = distinct
    row["bytes"] = nbytes
    row["nvfp4_us"] = graph_us([moe_call(ex, s) for s in group])
    row["gb_per_s"] = nbytes / row["nvfp4_us"] / 1e3
    row["read_fraction"] = nbytes / (row["nvfp4_us"] * 1e-6) / read_bw
    if bf16 is not None:
        row["grouped_bf16_us"] = graph_us([grouped_call(*bf16, s) for s in group])
        row["speedup_vs_grouped_bf16"] = row["grouped_bf16_us"] / row["nvfp4_us"]
        row["rel_diff_vs_grouped_bf16"] = rel_diff(
            moe_call(ex, group[0])(), grouped_call(*bf16, group[0])()
        )
    return row


def dense_bf16_us(pairs: int) -> float:
    """The prefill's useful FLOPs as two dense bf16 GEMMs (M = pairs), CUDA-graph timed."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    a = torch.randn(pairs, H, generator=gen, device=DEV).to(torch.bfloat16)
    w13 = torch.randn(2 * INTER, H, generator=gen, device=DEV).to(torch.bfloat16)
    h = torch.randn(pairs, INTER, generator=gen, device=DEV).to(torch.bfloat16)
    w2 = torch.randn(H, INTER, generator=gen, device=DEV).to(torch.bfloat16)

    def run() -> None:
        torch.mm(a, w13.t())
        torch.mm(h, w2.t())

    return graph_us([run], budget_ms=100.0)


def prefill_point(
    ex: Experts, bf16: tuple[torch.Tensor, torch.Tensor] | None, tokens: int
) -> dict[str, float | int]:
    pairs = tokens * TOP_K
    flops = 2.0 * pairs * (2 * INTER * H + H * INTER)
    group = steps(tokens, 2, seed=tokens, experts=ex.num_experts)
    row: dict[str, float | int] = {"tokens": tokens, "pairs": pairs, "flops": flops}
    row["nvfp4_us"] = graph_us([moe_call(ex, s) for s in group], budget_ms=100.0)
    row["nvfp4_tflops"] = flops / row["nvfp4_us"] / 1e6
    row["dense_bf16_us"] = dense_bf16_us(pairs)
    row["dense_bf16_tflops"] = flops / row["dense_bf16_us"] / 1e6
    row["fraction_of_dense_bf16"] = row["nvfp4_tflops"] / row["dense_bf16_tflops"]
    if bf16 is not None:
        row["grouped_bf16_us"] = graph_us([grouped_call(*bf16, s) for s in group], 100.0)
        row["grouped_bf16_tflops"] = flops / row["grouped_bf16_us"] / 1e6
        row["rel_diff_vs_grouped_bf16"] = rel_diff(
            moe_call(ex, group[0])(), grouped_call(*bf16, group[0])()
        )
    return row


ABLATIONS = {
    "default": NVFP4MoEConfig(),
    "dequant_triton": NVFP4MoEConfig(dequant="triton"),
    "route_sorted": NVFP4MoEConfig(route="sorted"),
    "no_pdl": NVFP4MoEConfig(pdl=False),
    "stages4": NVFP4MoEConfig(num_stages=4),
    "stages5": NVFP4MoEConfig(num_stages=5),
    # At T = 1: a third step of loads in flight without the registers stages4 takes (sm_90
    # compile: gate_up 165 against the plan's 128; capped, 128 and no spill), and the plan's
    # bytes in flight in one-tile steps (a step's copies are issued after its MMAs and a block
    # barrier: shorter steps issue them sooner; 127 registers, 39 KB shared); one-tile steps at
    # 4 and 6 stages bracket it (down at 6: 142 registers, 48 KB shared). H100 2026-12-07: none
    # faster than the plan at T = 1 (57.7 µs; these 58.8-63.2), stages4 3 % faster at T = 8
    # (perf/results/h100_2026-12-07b_t1_inflight); the H200, where T = 1 reads at half its
    # bandwidth, has not run them.
    "stages4_r128": NVFP4MoEConfig(num_stages=4, max_registers=128),
    "rows64_k1_s4": NVFP4MoEConfig(block_n=64, k_tiles=1, num_stages=4),
    "rows64_k1_s5": NVFP4MoEConfig(block_n=64, k_tiles=1, num_stages=5),
    "rows64_k1_s6": NVFP4MoEConfig(block_n=64, k_tiles=1, num_stages=6),
    # The decode tiles `plan_moe` chooses between: weight rows a program, K tiles a step.
    "rows64_k1": NVFP4MoEConfig(block_n=64, k_tiles=1),
    "rows64_k2": NVFP4MoEConfig(block_n=64, k_tiles=2),
    "rows128_k1": NVFP4MoEConfig(block_n=128, k_tiles=1),
    "rows128_k2": NVFP4MoEConfig(block_n=128, k_tiles=2),
    "block_n128_w8": NVFP4MoEConfig(block_n=128, num_warps=8),
    # 32 weight rows a program: below a warpgroup's 64, so Triton's dot is mma.sync, not wgmma:
    # no warpgroup-wide waits and twice the programs (768 at T = 1), but a K loop 40 % longer
    # (721 instructions a thread for 128 weights against 509: the fragment wants bytes
    # shuffled). H100 2026-12-06: T = 1 83.6 µs (2 warps) and 157.1 (4) against the plan's
    # 59.1 (perf/results/h100_2026-12-06h_copy65_ab).
    "rows32_w2_k2": NVFP4MoEConfig(block_n=32, num_warps=2, k_tiles=2),
    "rows32_w4_k2": NVFP4MoEConfig(block_n=32, num_warps=4, k_tiles=2),
    "warps8": NVFP4MoEConfig(num_warps=8),
    # Each projection's K over 2 or 4 programs (more programs per weight column at few tokens;
    # gate_up's splits summed by the reduce kernel, down's by the combine).
    "split2": NVFP4MoEConfig(split_k=2),
    "split2_k1": NVFP4MoEConfig(split_k=2, k_tiles=1),
    "split4_k1": NVFP4MoEConfig(split_k=4, k_tiles=1),
    # Split with registers capped so that the doubled grid is one wave (T = 1: 768 programs of
    # 4 warps; 96 registers give 5 programs an SM, 80 give 6, with no spill in the K loop): twice
    # the warps in flight. H100 2026-12-06 (the last split summing in-kernel instead of the
    # reduce): T = 1 75-80 µs against the plan's 57.8, T = 8 464-496 against 357; more warps do
    # not hide what a shorter K per program adds (perf/results/h100_2026-12-06_split_wide_serve).
    "split2_k1_r96": NVFP4MoEConfig(split_k=2, k_tiles=1, max_registers=96),
    "split2_k1_r80": NVFP4MoEConfig(split_k=2, k_tiles=1, max_registers=80),
}


PREFILL_ABLATIONS = {
    "default": NVFP4MoEConfig(),
    "block_m32": NVFP4MoEConfig(block_m=32),
    "block_m128": NVFP4MoEConfig(block_m=128),
    "block_m128_n128_w8": NVFP4MoEConfig(block_m=128, block_n=128, num_warps=8),
    "stages4": NVFP4MoEConfig(num_stages=4),
    "block_m64_n64_w4": NVFP4MoEConfig(block_m=64, block_n=64, num_warps=4),
    # Blocks of 128 pairs on 64 weight rows, one warpgroup, two stages: two programs an SM
    # (sm_90 compile: gate_up 168 registers, down 214, 86.5 KB shared each), so that one
    # program's nibble decode can run beside the other's MMA; the plan's 8-warp program is
    # alone on its SM (229-235 registers, 141 KB) and its two warpgroups decode, then multiply,
    # in step. Each program loads the 128 pairs' activations for half the rows. Measured slower
    # (H100 2026-12-06: 8 experts T 272-640 +7-15 %, 128 experts T 2048 5108.8 against 3000.4
    # µs; perf/results/h100_2026-12-06i_overlap_rows): not taken.
    "block_m128_n64_w4_s2": NVFP4MoEConfig(
        block_m=128, block_n=64, num_warps=4, num_stages=2, max_registers=0
    ),
    # A block's tail (pairs past BLOCK_M on the same decoded weights) and the register cap.
    "no_tail": NVFP4MoEConfig(tail_m=0, max_registers=0),
    "tail16_uncapped": NVFP4MoEConfig(tail_m=16, max_registers=0),
    "tail32": NVFP4MoEConfig(tail_m=32),
    # 256 weight rows a program: at 16 warps one program an SM whose four warpgroups share one
    # activation tile, where the plan's two 128-row programs an SM each load their own (half
    # the activations' L2 loads and shared memory per MMA). sm_90 compile, T 2048's block of
    # 64: 124 registers, no spill, 98 KB shared, the same 313-321 instructions a thread a K step.
    # Measured (H100 2026-12-06, E 128): T 2048 2877.6 µs against the plan's 2813.5, T 4096
    # 5337.2 against 5109.9; E 8, T 272: 530.4 against 371.5. Not taken.
    "rows256_w16": NVFP4MoEConfig(block_n=256, num_warps=16, max_registers=0),
    "rows256_w8": NVFP4MoEConfig(block_n=256, num_warps=8, max_registers=0),
    # Blocks of 256 pairs: an expert with 161-256 pairs (the slice's mixed steps; the real
    # model's prefill steps of 5-10K tokens) decodes its weights once instead of twice. The
    # activations of a block take 64 KB of shared memory a stage: two stages (sm_90 compile:
    # 255 registers with the 32-pair tail, 213-244 without, no spill). Measured (H100
    # 2026-12-06, E 8, µs against the plan's): T 272 535.6 / 371.1, T 414 580.2 / 552.9, T 640
    # 1018.4 / 846.3; without the tail slower still; served at C 16-128 -6 to -16 % output
    # tokens/s (perf/results/h100_2026-12-06g_pairs256_copy_test). Not taken.
    "pairs256": NVFP4MoEConfig(block_m=256, num_stages=2, max_registers=0),
    "pairs256_no_tail": NVFP4MoEConfig(block_m=256, num_stages=2, tail_m=0, max_registers=0),
    "pairs256_n64_w4": NVFP4MoEConfig(
        block_m=256, block_n=64, num_warps=4, num_stages=2, tail_m=0, max_registers=0
    ),
}


def ints(text: str) -> list[int]:
    """A comma-separated list of token counts ('' for none)."""
    return [int(v) for v in text.split(",") if v]


def chosen(table: dict[str, NVFP4MoEConfig], names: list[str]) -> list[tuple[str, NVFP4MoEConfig]]:
    """The variants of `table` named in `names` (all when none is: each compiles its own
    kernels, so a run may ask for a few)."""
    return [(name, cfg) for name, cfg in table.items() if not names or name in names]


def prefill_ablations(ex: Experts, tokens: int, names: list[str]) -> list[dict[str, float | int]]:
    """Tile variants of the sorted route at one prefill size (graph µs, TFLOP/s)."""
    flops = 2.0 * tokens * TOP_K * (2 * INTER * H + H * INTER)
    group = steps(tokens, 2, seed=tokens, experts=ex.num_experts)
    rows = []
    for name, cfg in chosen(PREFILL_ABLATIONS, names):
        us = graph_us([moe_call(ex, s, cfg) for s in group], budget_ms=100.0)
        rows.append({"tokens": tokens, "variant": name, "us": us, "tflops": flops / us / 1e6})
    return rows


def ablations(
    ex: Experts, tokens: list[int], read_bw: float, names: list[str]
) -> list[dict[str, float | int]]:
    """Other decodes, routes and tiles at a few sizes (graph µs, fraction of read bandwidth)."""
    rows = []
    for t in tokens:
        group = steps(t, SETS, seed=t, experts=ex.num_experts)
        nbytes = sum(s.distinct() for s in group) / len(group) * ex.bytes_per_expert()
        for name, cfg in chosen(ABLATIONS, names):
            us = graph_us([moe_call(ex, s, cfg) for s in group])
            frac = nbytes / (us * 1e-6) / read_bw
            rows.append({"tokens": t, "variant": name, "us": us, "read_fraction": frac})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=DECODE_TOKENS)
    parser.add_argument("--prefill", default="2048", help="prefill token counts, comma-separated")
    parser.add_argument("--experts", type=int, default=EXPERTS)
    parser.add_argument("--no-grouped", action="store_true", help="skip the bf16 grouped-mm path")
    parser.add_argument("--ablations", action="store_true")
    parser.add_argument(
        "--ablation-tokens", default="1,8,32", help="token counts of the decode ablations"
    )
    parser.add_argument("--prefill-ablations", action="store_true")
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated ABLATIONS and PREFILL_ABLATIONS names (default: all)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prefills = [int(v) for v in args.prefill.split(",") if int(v) > 0]
    variants = [v for v in args.variants.split(",") if v]
    torch.backends.cuda.matmul.allow_tf32 = False

    read_bw = read_bandwidth()
    launch = launch_us()
    print(
        f"device read-only bandwidth {read_bw / 1e12:.2f} TB/s; "
        f"empty-kernel launch in a graph {launch:.2f} µs"
    )
    ex = random_experts(args.experts)
    use_grouped = not args.no_grouped and grouped_mm_available(DEV, torch.bfloat16)
    bf16 = ex.bf16() if use_grouped else None
    print(f"expert bytes (w13 + w2, packed + scales): {ex.bytes_per_expert() / 1e6:.1f} MB")

    decode = []
    print("\ndecode, CUDA-graph replay (bytes: distinct experts x packed weights + scales)")
    print(
        f"{'T':>4} {'pairs':>5} {'experts':>7} {'MB':>8} {'nvfp4 µs':>9} {'GB/s':>7} "
        f"{'%read':>6} {'bf16 grp µs':>11} {'×grp':>6} {'rel diff':>9}"
    )
    for t in ints(args.tokens):
        r = decode_point(ex, bf16, t, read_bw)
        decode.append(r)
        grouped = (
            f"{r['grouped_bf16_us']:>11.1f} {r['speedup_vs_grouped_bf16']:>6.2f} "
            f"{r['rel_diff_vs_grouped_bf16']:>9.2e}"
            if bf16 is not None
            else f"{'-':>11} {'-':>6} {'-':>9}"
        )
        print(
            f"{t:>4} {r['pairs']:>5} {r['distinct_experts']:>7.1f} {r['bytes'] / 1e6:>8.1f} "
            f"{r['nvfp4_us']:>9.1f} {r['gb_per_s']:>7.0f} {100 * r['read_fraction']:>5.1f}% "
            + grouped
        )

    prefill = []
    for tokens in prefills:
        r = prefill_point(ex, bf16, tokens)
        prefill.append(r)
        print(f"\nprefill T = {tokens} ({r['pairs']} pairs), CUDA-graph replay")
        print(
            f"  nvfp4 {r['nvfp4_us']:9.1f} µs  {r['nvfp4_tflops']:6.1f} TFLOP/s   "
            f"dense bf16 matmul {r['dense_bf16_us']:9.1f} µs  {r['dense_bf16_tflops']:6.1f} "
            f"TFLOP/s   -> {100 * r['fraction_of_dense_bf16']:.1f}% of dense"
        )
        if bf16 is not None:
            print(
                f"  bf16 grouped-mm {r['grouped_bf16_us']:9.1f} µs  "
                f"{r['grouped_bf16_tflops']:6.1f} TFLOP/s   rel diff "
                f"{r['rel_diff_vs_grouped_bf16']:.2e}"
            )

    abl = []
    if args.ablations:
        print("\nablations (graph µs / % of read bandwidth)")
        abl = ablations(ex, ints(args.ablation_tokens), read_bw, variants)
        for r in abl:
            print(
                f"  T={r['tokens']:>3} {r['variant']:<15} {r['us']:9.1f} µs "
                f"{100 * r['read_fraction']:5.1f}%"
            )
    if args.ablations or args.prefill_ablations:
        for tokens in prefills:
            print(f"prefill T = {tokens}, {ex.num_experts} experts (graph µs / TFLOP/s)")
            pre = prefill_ablations(ex, tokens, variants)
            abl += pre
            for r in pre:
                print(f"  {r['variant']:<20} {r['us']:9.1f} µs {r['tflops']:6.1f} TFLOP/s")

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shapes": {"experts": ex.num_experts, "hidden": H, "intermediate": INTER, "top_k": TOP_K},
        "read_bandwidth_bytes_per_s": read_bw,
        "empty_kernel_launch_us": launch,
        "expert_bytes": ex.bytes_per_expert(),
        "decode": decode,
        "prefill": prefill,
        "ablations": abl,
    }
    write_result(result, "bench_nvfp4_moe.json", args.out)


if __name__ == "__main__":
    main()
