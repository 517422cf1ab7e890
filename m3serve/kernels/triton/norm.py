"""Gemma RMSNorm in Triton, optionally fused with the residual add that precedes it.

Semantics are those of `m3serve.kernels.norm`: normalize in fp32, scale by (1 + w) in fp32 and
cast once at the end. The residual add rounds to the activation dtype first (as the torch
`residual + x` does), and the norm reads that rounded sum.

One program normalizes one row held entirely in registers (rows up to 32768 wide; the model's
is 6144), so a row is read once and written once. Grids depend only on shapes and nothing
syncs with the host, so the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# A row lives in registers; beyond this the per-thread footprint spills.
MAX_HIDDEN = 32768

# What the kernel does with the residual stream (a constexpr, so each mode compiles alone).
_PLAIN = 0  # out = norm(x)
_ADD = 1  # residual += x (in place), out = norm(residual)
_COPY = 2  # residual = x (a fresh copy), out = norm(residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    stride_x,
    res_ptr,
    stride_res,
    out_ptr,
    stride_out,
    w_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
):
    # int64 row offsets: a long prefill chunk times the hidden size can pass 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if MODE == 1:
        res_ptrs = res_ptr + row * stride_res + cols
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        # Round the sum to the stream dtype before normalizing: the stored residual and the
        # normalized value must come from the same number, as in the torch reference.
        s = (r.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, s, mask=mask)
    elif MODE == 2:
        s = x
        tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
    else:
        s = x
    xf = s.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum of squares.
    mean_sq = tl.sum(xf * xf, axis=0) / N
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Same order as the reference: normalize, then scale by (1 + w), both in fp32.
    y = (xf * rstd) * (1.0 + w)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor, name: str) -> Tensor:
    """A [rows, hidden] view of `t` without copying (the kernel writes through it)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as err:
        raise ValueError(f"{name} must be viewable as [rows, hidden]") from err


def _launch(
    x: Tensor, res: Tensor | None, out: Tensor, weight: Tensor, eps: float, mode: int
) -> None:
    n = x.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} is above the {MAX_HIDDEN} one row in registers allows")
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    x2 = _rows(x, "x")
    out2 = _rows(out, "out")
    rows = x2.shape[0]
    if rows == 0:
        return
    # Without a residual tensor the kernel never touches it; x stands in as a valid pointer.
    res2 = x2 if res is None else _rows(res, "residual")
    block = triton.next_power_of_2(n)
    # About 16 fp32 values per thread: enough in flight to stream the row, no spills.
    num_warps = max(1, min(16, block // 512))
    _rms_norm_kernel[(rows,)](
        x2,
        x2.stride(0),
        res2,
        res2.stride(0),
        out2,
        out2.stride(0),
        weight,
        eps,
        N=n,
        BLOCK=block,
        MODE=mode,
        num_warps=num_warps,
    )


def _check_out(x: Tensor, out: Tensor) -> None:
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError("out must have x's shape, dtype and device")


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """Gemma RMSNorm of each row of `x` ([..., hidden]); the result has x's dtype.

    `out`, when given, receives the result (preallocated buffers for CUDA graphs).
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_out(x, out)
    _launch(x, None, out, weight, eps, _PLAIN)
    return out


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`residual += x`, then Gemma RMSNorm of the new residual, in one pass over the row.

    `residual` is updated in place. When it is None, x is the first input of the stack: the
    new residual is a fresh copy of x (never x itself, so later in-place adds cannot alias the
    caller's tensor). Returns (normed, residual).
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        res = torch.empty_like(x, memory_format=torch.contiguous_format)
        _launch(x, res, out, weight, eps, _COPY)
        return out, res
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError("residual must have x's shape, dtype and device")
    _launch(x, residual, out, weight, eps, _ADD)
    return out, residual
