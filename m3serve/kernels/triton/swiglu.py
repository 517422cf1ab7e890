"""SwiGLU-OAI in one Triton pass: the MLPs' activation between gate_up and down.

Semantics are those of `m3serve.kernels.activation.swiglu_oai` (gate = first half of the fused
gate_up row, clamped from above; up clamped on both sides; (up + 1) * gate * sigmoid(alpha *
gate)), computed in fp32 and rounded once to the input dtype. The torch form is six kernels, each
rounding to bf16; at decode their launches cost more than the arithmetic, which this removes.
Grids depend only on shapes: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _swiglu_oai_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    width,
    alpha,
    limit,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + width + cols, mask=ok, other=0.0).to(tl.float32)
    # NaN passes through, as in torch.clamp: a corrupted activation must not look clamped.
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
    h = (up + 1.0) * (gate * tl.sigmoid(alpha * gate))
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu_oai(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """[..., 2I] -> [..., I] in gate_up's dtype; rows may be strided, the last dim not."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim ({gate_up.shape[-1]}) must be even")
    if gate_up.stride(-1) != 1:
        raise ValueError("gate_up must be contiguous in its last dimension")
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and width:
        grid = (rows.shape[0], triton.cdiv(width, _BLOCK))
        _swiglu_oai_kernel[grid](
            rows, rows.stride(0), out, out.stride(0), width, float(alpha), float(limit),
            BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], width)
