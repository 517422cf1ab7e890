"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """What one request asks of the sampler. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def filter_probs(probs: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Zero out tokens excluded by top-k, top-p and min-p (probs: [V], not renormalized)."""
    if cfg.top_k > 0 and cfg.top_k < probs.shape[-1]:
        kth = torch.topk(probs, cfg.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if cfg.min_p > 0.0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = mass_before >= cfg.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order[drop], 0.0)
    return probs


def sample_token(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None
) -> int:
    """One token id from logits [V]."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    probs = filter_probs(probs, cfg)
    # Exponential race == sampling from probs / sum(probs), without a host round trip per row.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))
