"""Token sampling from logits, as exact torch references: top-k, top-p and min-p filters, the
exponential-race draw, repetition / frequency / presence penalties, and a grammar's token
bitmask.

`draw_token` samples one row (the single-request generate loop); the batched functions serve the
engine's `Sampler` (`m3serve.core.sampler`), which holds the per-request state. Which requests
are greedy is the caller's rule (`SamplingParams.greedy`); these functions only draw.
"""

from __future__ import annotations

import torch


def filter_probs(
    probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Zero out tokens excluded by top-k, top-p and min-p (probs: [V], not renormalized).

    top_k <= 0 or >= V keeps every token; top_p 1 and min_p 0 are off.
    """
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = mass_before >= top_p * sorted_probs.sum()
        probs = probs.scatter(0, order[drop], 0.0)
    return probs


def draw_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id drawn from softmax(logits [V] / temperature) after the filters."""
    probs = torch.softmax(logits.float() / max(temperature, MIN_TEMPERATURE), dim=-1)
    probs = filter_probs(probs, top_k, top_p, min_p)
    # Exponential race == sampling from probs / sum(probs), without a host round trip per row.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))


# ------------------------------------------------------------------------- batched sampling

# Below this, logits / temperature can overflow to inf and softmax to NaN; the draw is already
# the argmax there (vLLM uses the same floor).
MIN_TEMPERATURE = 1e-5


def filter_probs_batch(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per-row `filter_probs` for probs [B, V] with one sort for the whole batch.

    top_k [B] int64 in [1, V] (V keeps everything); top_p, min_p [B] float. Excluded tokens
    become 0 and kept ones keep their value (not renormalized).
    """
    # Stable, so tied tokens at the top-p boundary fall the same way whatever the batch.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kth = sorted_probs.gather(1, (top_k - 1).unsqueeze(1))
    floor = min_p.unsqueeze(1) * sorted_probs[:, :1]
    # Ties with the k-th value stay, as in filter_probs. Both cuts are value thresholds, so in
    # sorted order each drops a suffix and the kept mass below is a prefix sum.
    drop = (sorted_probs < kth) | (sorted_probs < floor)
    drop |= _top_p_drop(sorted_probs.masked_fill(drop, 0.0), top_p)
    return probs.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), 0.0)


def _top_p_drop(sorted_kept: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sorted positions past the smallest prefix whose mass reaches top_p of the kept mass."""
    mass = torch.cumsum(sorted_kept, dim=-1)
    # The total is the scan's last entry rather than a sum(): on CPU a one-row sum is split
    # across threads and rounds differently from the same row inside a batch.
    reached = mass - sorted_kept >= top_p.unsqueeze(1) * mass[:, -1:]
    # top_p == 1 is off: rounding must not let the scan "reach" 1 before the tail.
    return reached & (top_p < 1.0).unsqueeze(1)


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on raw logits [B, V] (a new tensor).

    seen [B, V] bool marks prompt and output tokens (repetition); counts [B, V] holds output
    tokens only (frequency, presence); the penalties are [B] floats, neutral at 1, 0, 0.
    """
    r = repetition.unsqueeze(1)
    # Divide positive logits and multiply negative ones, so r > 1 always lowers a seen token.
    shrunk = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, shrunk, logits)
    generated = counts.to(logits.dtype)
    appeared = (counts > 0).to(logits.dtype)
    return logits - frequency.unsqueeze(1) * generated - presence.unsqueeze(1) * appeared


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf for every token a packed bitmask [B, ceil(V/32)] (int32; bit j of
    word w is token 32w + j) does not allow. Plain tensor ops, so any device runs it."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: & 1 still reads bit j
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
