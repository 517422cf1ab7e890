"""Weight holders: plain tensors registered as frozen parameters, filled by the loader."""

from __future__ import annotations

import torch
from torch import nn


def weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialized on purpose: the loader writes every element and checks nothing is missing.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """A bias-free projection y = x W^T whose math the backend owns."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = weight(out_features, in_features, dtype=dtype, device=device)


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
