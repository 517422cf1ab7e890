"""Weight holders: plain tensors registered as frozen parameters, filled by the loader."""

from __future__ import annotations

import torch
from torch import nn

from m3serve.kernels.quant import MXFP8_BLOCK
from m3serve.model.weights import LinearWeight, Mxfp8Weight, WeightFormat


def weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialized on purpose: the loader writes every element and checks nothing is missing.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """A bias-free projection y = x W^T whose math the backend owns. Dense: `weight` [out, in]
    in the compute dtype. MXFP8: `weight` holds the e4m3 codes and `weight_scale` the E8M0
    exponents of each 32 inputs, as the checkpoint stores them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fmt: WeightFormat = "dense",
    ) -> None:
        super().__init__()
        self.fmt = fmt
        if fmt == "MXFP8":
            self.weight = weight(
                out_features, in_features, dtype=torch.float8_e4m3fn, device=device
            )
            blocks = in_features // MXFP8_BLOCK
            self.weight_scale = weight(out_features, blocks, dtype=torch.uint8, device=device)
            # A bf16 copy of W a backend may add after loading (`--mxfp8-bf16-copy`): a buffer,
            # so that the weights' byte count holds it.
            self.weight_bf16: torch.Tensor | None
            self.register_buffer("weight_bf16", None, persistent=False)
        else:
            self.weight = weight(out_features, in_features, dtype=dtype, device=device)

    @property
    def data(self) -> LinearWeight:
        """What the backend's `linear` reads."""
        if self.fmt == "MXFP8":
            return Mxfp8Weight(self.weight, self.weight_scale, self.weight_bf16)
        return self.weight


class Norm(nn.Module):
    """Gemma RMSNorm weight (the stored value is the offset w in x * (1 + w))."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = weight(dim, dtype=dtype, device=device)


class Table(nn.Module):
    """A [rows, dim] matrix: the token embedding or the LM head."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = weight(rows, dim, dtype=dtype, device=device)
