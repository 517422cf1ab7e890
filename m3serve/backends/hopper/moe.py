"""The routed experts on the GPU in plain torch, without host syncs (so decode can be captured
in a CUDA graph): tokens sorted by expert, one grouped matmul per projection, and a combine
that writes each (token, slot) once, so the sum is deterministic (no atomics)."""

from __future__ import annotations

import torch

from m3serve.kernels.activation import swiglu_oai

# torch's grouped matmul (bf16, sm_90) — private API, present since torch 2.8.
_grouped_mm = getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    if _grouped_mm is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def moe_experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """sum_k weights[t, k] * Expert_{ids[t, k]}(x[t]); w13 [E, 2I, H], w2 [E, H, I]."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # bincount reads the max back to the host; a scatter-add of ones does not.
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = order // top_k
    hidden = _grouped_mm(x[rows], w13.transpose(1, 2), offs=offsets)
    out = _grouped_mm(swiglu_oai(hidden, alpha, limit), w2.transpose(1, 2), offs=offsets)
    out = out.float() * weights.reshape(-1)[order, None]
    combined = torch.empty(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    combined[order] = out
    return combined.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def moe_experts_masked(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Sync-free fallback: every expert over every token, masked by the routing weights (ids
    >= E, experts held elsewhere, match none). Exact but reads all experts each step: small
    expert counts (tests), and dense experts under expert parallelism."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        share = (weights * (ids == expert)).sum(dim=1, keepdim=True)
        hidden = swiglu_oai(x @ w13[expert].t(), alpha, limit)
        out += (hidden @ w2[expert].t()).float() * share
    return out.to(x.dtype)
