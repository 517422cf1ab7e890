"""Quantized linear layers: the torch references the Triton kernels are tested against.

`mxfp8_linear_reference` is the semantics of `m3serve.kernels.triton.mxfp8_linear`: the exact
dequantized weight, products and sums in float32. The kernel's result is this, rounded once to
the activation dtype (up to the order of the fp32 sums). On CUDA the caller decides TF32:
`torch.backends.cuda.matmul.allow_tf32` must be False for an fp32-exact reference.
"""

from __future__ import annotations

import torch

from m3serve.kernels.quant import dequant_mxfp8


def mxfp8_linear_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``x.float() @ W.T`` in float32 for W = dequant_mxfp8(codes, scales); x [..., K]."""
    return x.float() @ dequant_mxfp8(codes, scales).t()
