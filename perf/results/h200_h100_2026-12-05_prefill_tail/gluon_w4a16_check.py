"""For the next device call (never run yet): `perf/results/h200_h100_2026-12-05_prefill_tail/gluon_w4a16.py`'s tile product on the GPU,
exactness against the dequantized torch reference, then its time at one token on 4 experts'
gate_up rows stacked (24576 x 6144: 384 programs, the served T = 1 gate_up's grid and bytes) as
GB/s of the read bandwidth measured in the same run.

    PYTHONPATH=$PWD:perf python3 perf/results/h200_h100_2026-12-05_prefill_tail/gluon_w4a16_check.py
"""

import importlib.util
from pathlib import Path

import torch
from gpu_timing import graph_us, read_bandwidth

from m3serve.kernels.nvfp4_tiles import tile_rows
from m3serve.kernels.quant import dequant_nvfp4, quant_nvfp4

spec = importlib.util.spec_from_file_location("g", Path(__file__).with_name("gluon_w4a16.py"))
assert spec is not None and spec.loader is not None
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)


def split_order(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """x [M, K] with each tile's even elements first, then its odd ones."""
    m, k = x.shape
    t = x.view(m, k // tile, tile // 2, 2)
    return torch.cat([t[..., 0], t[..., 1]], dim=-1).reshape(m, k).contiguous()


def run(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape[0] * 32, x.shape[1]
    out = torch.zeros(n, 16, dtype=torch.float32, device="cuda")
    g.w4a16_tile_kernel[(n // 64,)](codes, scales, split_order(x), out, k, x.shape[0], num_warps=4)
    return out[:, : x.shape[0]]


def main() -> None:
    torch.manual_seed(0)
    n, k = 4 * 6144, 6144
    w = torch.randn(n, k, device="cuda") * 0.05
    packed, scale, _ = quant_nvfp4(w, torch.tensor(1.0, device="cuda"))
    codes, scales = tile_rows(packed, 2).contiguous(), tile_rows(scale, 16).contiguous()
    ref_w = dequant_nvfp4(packed, scale, torch.tensor(1.0, device="cuda"))
    for m in (1, 3, 8, 16):
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
        got = run(codes, scales, x)
        ref = ref_w @ x.float().t()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"M {m:2d}: max error {err:.2e} of the output scale")
    x = (torch.randn(1, k, device="cuda") * 2).to(torch.bfloat16)
    xs = split_order(x)
    out = torch.zeros(n, 16, dtype=torch.float32, device="cuda")

    def call() -> None:
        g.w4a16_tile_kernel[(n // 64,)](codes, scales, xs, out, k, 1, num_warps=4)

    us = graph_us([call])
    read = read_bandwidth()
    nbytes = codes.numel() + scales.numel()
    print(f"T = 1, {nbytes / 1e6:.1f} MB: {us:.1f} µs, {nbytes / us / 1e3:.0f} GB/s "
          f"= {100 * nbytes / us / 1e-6 / read:.1f} % of {read / 1e12:.2f} TB/s")  # fmt: skip


if __name__ == "__main__":
    main()
