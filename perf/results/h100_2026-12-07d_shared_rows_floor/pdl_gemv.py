"""Does the MXFP8 GEMV gain from starting before its input is ready? A norm -> GEMV chain at
batch 1 (the q/k/v projection's shape), in CUDA graphs, weights rotated past L2:
  served : the backend's rms_norm and mxfp8_linear;
  copy   : copies of the two kernels, no PDL (must time as served);
  pdl    : the norm triggers its dependents at once; the GEMV is launched with programmatic
           dependent launch, loads its first weight tile, then waits for the norm (gdc_wait)
           before it reads x;
  pdl2   : as pdl, first two weight tiles before the wait."""

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "perf")
from gpu_timing import graph_us

from m3serve.kernels.triton.mxfp8_kernels import _e8m0_scale
from m3serve.kernels.triton.mxfp8_linear import mxfp8_linear
from m3serve.kernels.triton.norm import rms_norm


@triton.jit
def norm_kernel(
    x_ptr, out_ptr, w_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr
):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xf = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, ((xf * rstd) * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _step(codes, e, x_ptr, k0, rk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    scale = _e8m0_scale(e)
    w = codes.to(tl.float32)
    xm = tl.load(x_ptr + k0 + rk).to(tl.float32)
    prod = tl.reshape(w * xm[None, :], [BLOCK_N, BLOCK_K // 32, 32])
    return tl.sum(tl.sum(prod, axis=2) * scale, axis=1)


@triton.jit
def gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    stride_cn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WAIT: tl.constexpr,
    AHEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, BLOCK_K // 32)
    c_ptrs = codes_ptr + rn_load[:, None] * stride_cn + rk[None, :]
    s_ptrs = scales_ptr + rn_load[:, None] * stride_sn + rg[None, :]
    # The first AHEAD weight tiles do not depend on the previous kernel: load them first.
    c0 = tl.load(c_ptrs)
    e0 = tl.load(s_ptrs)
    if AHEAD == 2:
        c1 = tl.load(c_ptrs + BLOCK_K)
        e1 = tl.load(s_ptrs + BLOCK_K // 32)
    if WAIT:
        tl.extra.cuda.gdc_wait()
    acc = _step(c0, e0, x_ptr, 0, rk, BLOCK_N, BLOCK_K)
    start = BLOCK_K
    if AHEAD == 2:
        acc += _step(c1, e1, x_ptr, BLOCK_K, rk, BLOCK_N, BLOCK_K)
        start = 2 * BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        codes = tl.load(c_ptrs + k0)
        e = tl.load(s_ptrs + k0 // 32)
        acc += _step(codes, e, x_ptr, k0, rk, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


def chain(kind, x, nw, y, codes, scales, out):
    if kind == "served":
        rms_norm(x, nw, 1e-6, out=y)
        mxfp8_linear(y, codes, scales, out)
        return
    pdl = kind.startswith("pdl")
    norm_kernel[(1,)](x, y, nw, 1e-6, N=6144, BLOCK=8192, TRIGGER=pdl, num_warps=16)
    n = codes.shape[0]
    gemv_kernel[(triton.cdiv(n, 4),)](
        y,
        codes,
        scales,
        out,
        n,
        6144,
        codes.stride(0),
        scales.stride(0),
        BLOCK_N=4,
        BLOCK_K=1024,
        WAIT=pdl,
        AHEAD=2 if kind == "pdl2" else 1,
        num_warps=4,
        num_stages=3,
        **({"launch_pdl": True} if pdl else {}),
    )


dev = torch.device("cuda")
torch.manual_seed(0)
x = torch.randn(1, 6144, device=dev).to(torch.bfloat16)
nw = (torch.randn(6144, device=dev) * 0.1).to(torch.bfloat16)
for n in (9856, 6144, 2048):
    ws = [
        (
            (torch.randn(n, 6144, device=dev) * 16).to(torch.float8_e4m3fn),
            torch.randint(118, 124, (n, 192), device=dev, dtype=torch.uint8),
        )
        for _ in range(max(2, 240_000_000 // (n * 6144)))
    ]
    y = torch.empty(1, 6144, device=dev, dtype=torch.bfloat16)
    outs = {}
    for kind in ("served", "copy", "pdl", "pdl2"):
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        chain(kind, x, nw, y, *ws[0], out)
        outs[kind] = out.clone()
        us = graph_us([lambda c=c, s=s, k=kind, o=out: chain(k, x, nw, y, c, s, o) for c, s in ws])
        same = torch.equal(outs[kind], outs["served"])
        mb = n * 6144 * (1 + 1 / 32) / 1e6
        print(
            f"N {n:5d} ({mb:5.1f} MB) {kind:>6}: {us:6.2f} us a norm + GEMV "
            f"({mb / us:4.2f} TB/s), bitwise as served: {same}",
            flush=True,
        )
