"""Mixture of experts: sigmoid + bias top-k routing and the routed expert sum (torch reference)."""

from __future__ import annotations

import torch

from m3serve.kernels.activation import swiglu_oai


def route_topk(
    x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, k] fp32, expert ids [T, k]).

    The correction bias only decides *which* experts win; the mixing weights are the unbiased
    sigmoid scores of the winners, renormalized to sum to one.
    """
    logits = x.float() @ router_weight.float().t()
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """sum_k weights[t, k] * Expert_{ids[t, k]}(x[t]).

    w13: [E, 2I, H] with the gate rows first, w2: [E, H, I]. Ids >= E are skipped (experts held
    elsewhere, `local_expert_ids`).
    """
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    # Skipped ids sort last, past the counts of the experts held here.
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()[: w13.shape[0]]
    token_of = order // ids.shape[1]
    slot_of = order % ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        slots = slot_of[start : start + count]
        start += count
        hidden = swiglu_oai(x[tokens] @ w13[expert].t(), alpha, limit)
        y = (hidden @ w2[expert].t()) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def local_expert_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> ids into the `count` experts held from `first` on; the ids of
    experts not held become `count` (which `moe_experts` skips)."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, count)
