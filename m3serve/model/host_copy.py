"""Small host arrays (a step's token ids, positions, page changes, sampling knobs) onto the
device without waiting for the kernels already queued there."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(
    values: np.ndarray | Sequence[int] | Sequence[Sequence[float]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A small host array as a tensor on `device`, without waiting for the device: a plain
    `.to(cuda)` synchronizes with the stream, so every kernel queued before it must finish
    first; a copy from pinned memory is queued behind them instead (the pinned block is held
    until the copy has run: torch's caching host allocator records it)."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
