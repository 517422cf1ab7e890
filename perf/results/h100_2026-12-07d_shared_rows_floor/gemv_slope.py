"""The MXFP8 GEMV at M = 1 from L2 at several weight sizes: the slope is the kernel's own
streaming rate, the intercept its fixed cost (launch, ramp, tail)."""

import sys

import torch

sys.path.insert(0, "perf")
from gpu_timing import graph_us

from m3serve.kernels.triton.mxfp8_linear import Mxfp8Plan, mxfp8_linear

dev = torch.device("cuda")
x = torch.randn(1, 6144, device=dev).to(torch.bfloat16)
for plan in (None, Mxfp8Plan(1, 4, 2048, 1, 4, 4, gemv=True)):
    pts = []
    for n in (512, 1024, 2048, 3072, 4096):
        codes = (torch.randn(n, 6144, device=dev) * 16).to(torch.float8_e4m3fn)
        scales = torch.randint(118, 124, (n, 192), device=dev, dtype=torch.uint8)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        us = graph_us([lambda: mxfp8_linear(x, codes, scales, out, plan=plan)])
        mb = n * 6144 * (1 + 1 / 32) / 1e6
        pts.append((mb, us))
        print(f"{'served' if plan is None else 'k2048 s4'} N {n:5d} {mb:6.1f} MB {us:7.2f} us")
    (m0, u0), (m1, u1) = pts[1], pts[3]
    rate = (m1 - m0) / (u1 - u0)  # MB per µs = TB/s
    print(f"  slope N 1024->3072: {rate:.2f} TB/s, intercept {u0 - m0 / rate:.2f} us")
