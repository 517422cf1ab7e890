"""Device check of `perf/results/h200_h100_2026-12-05_prefill_tail/gluon_prefill.py`: exactness against the dequantized torch
reference, then the prefill (T = 2048, 8192 pairs, 64 a expert) time of gate_up + down shaped
grouped products beside the served `nvfp4_moe` and the dense bf16 rate, one run.

    PYTHONPATH=$PWD:$PWD/perf python3 perf/results/h200_h100_2026-12-05_prefill_tail/gluon_prefill_check.py
"""

import importlib.util
from pathlib import Path

import torch
from bench_nvfp4_moe import ALPHA, E, H, INTER, LIMIT, TOP_K, dense_bf16_us, random_experts
from gpu_timing import graph_us

from m3serve.kernels.nvfp4_tiles import tile_rows
from m3serve.kernels.quant import dequant_nvfp4
from m3serve.kernels.triton.nvfp4_moe import nvfp4_moe

spec = importlib.util.spec_from_file_location("g", Path(__file__).with_name("gluon_prefill.py"))
assert spec is not None and spec.loader is not None
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
DEV = torch.device("cuda")


def split_order(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """x [..., K] with each tile's even elements first, then its odd ones."""
    *lead, k = x.shape
    t = x.reshape(*lead, k // tile, tile // 2, 2)
    return torch.cat([t[..., 0], t[..., 1]], dim=-1).reshape(*lead, k).contiguous()


def launch(codes, scales, xs, out, n, k, m, bm, stages):
    grid = (n // 128, codes.shape[0])
    g.w4a16_grouped_kernel[grid](codes, scales, xs, out, n, k, m, BM=bm, STAGES=stages,
                                 num_warps=8)  # fmt: skip


def exactness(bm: int, stages: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    for e_count, n, k, m in ((2, 256, 768, 64), (2, 256, 1024, 50), (1, 6144, 6144, 64)):
        codes = torch.randint(0, 256, (e_count, n, k // 2), generator=gen, device=DEV)
        codes = codes.to(torch.uint8)
        scales = (torch.rand(e_count, n, k // 16, generator=gen, device=DEV) * 1.75 + 0.25).to(
            torch.float8_e4m3fn
        )
        x = torch.randn(e_count, m, k, generator=gen, device=DEV).to(torch.bfloat16)
        out = torch.zeros(e_count, n, bm, device=DEV)
        launch(tile_rows(codes, 2), tile_rows(scales, 16), split_order(x), out, n, k, m, bm,
               stages)  # fmt: skip
        worst = 0.0
        for e in range(e_count):
            w = dequant_nvfp4(codes[e], scales[e], torch.tensor(1.0, device=DEV))
            ref = w @ x[e].float().t()
            err = (out[e, :, :m] - ref).abs().max() / ref.abs().max()
            worst = max(worst, err.item())
        print(f"  exact? E {e_count} N {n} K {k} M {m}: max error {worst:.2e} of the output scale")


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    for bm, stages in ((64, 3),):
        exactness(bm, stages)
    ex = random_experts()
    w13, s13, _, w2, s2, _ = ex.args()
    m = 8192 // E
    gen = torch.Generator(device=DEV).manual_seed(2)
    x13 = torch.randn(E, m, H, generator=gen, device=DEV).to(torch.bfloat16)
    x2 = torch.randn(E, m, INTER, generator=gen, device=DEV).to(torch.bfloat16)
    flops = 2.0 * 8192 * (2 * INTER * H + H * INTER)
    dense = dense_bf16_us(8192)
    print(f"dense bf16: {dense:.1f} µs, {flops / dense / 1e6:.1f} TFLOP/s")

    def report(name: str, us: float) -> None:
        tf = flops / us / 1e6
        print(f"  {name:<34} {us:9.1f} µs {tf:7.1f} TFLOP/s {100 * dense / us:6.1f} % of dense")

    # The served MoE: uniform routing (64 pairs an expert, as the grouped product) and random.
    x = torch.randn(2048, H, generator=gen, device=DEV).to(torch.bfloat16)
    t = torch.arange(2048, device=DEV)[:, None] * TOP_K + torch.arange(TOP_K, device=DEV)
    uniform = (t % E).to(torch.int32)
    weights = torch.full((2048, TOP_K), 0.5, device=DEV)
    scores = torch.rand(2048, E, generator=gen, device=DEV)
    random_ids = torch.topk(scores, TOP_K, dim=-1).indices.to(torch.int32)
    for name, ids in (("served nvfp4_moe, uniform routing", uniform),
                      ("served nvfp4_moe, random routing", random_ids)):  # fmt: skip
        us = graph_us([lambda ids=ids: nvfp4_moe(x, weights, ids, *ex.args(), ALPHA, LIMIT)], 100)
        report(name, us)
    out13 = torch.empty(E, 2 * INTER, 128, device=DEV)
    out2 = torch.empty(E, H, 128, device=DEV)
    for bm, stages in ((64, 2), (64, 3), (64, 4)):

        def both(bm=bm, stages=stages) -> None:
            launch(w13, s13, x13, out13, 2 * INTER, H, m, bm, stages)
            launch(w2, s2, x2, out2, H, INTER, m, bm, stages)

        def gate_up(bm=bm, stages=stages) -> None:
            launch(w13, s13, x13, out13, 2 * INTER, H, m, bm, stages)

        report(f"gluon BM {bm} stages {stages}", graph_us([both], 100))
        us = graph_us([gate_up], 100)
        print(f"    gate_up alone {us:.1f} µs, {2.0 * 8192 * 2 * INTER * H / us / 1e6:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
