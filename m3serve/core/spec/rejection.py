"""Sampled verification: per-token rejection sampling and block verification.

Both keep the committed tokens distributed exactly as the target's (temperature / top-k /
top-p processed) distribution. q is the draft's processed distribution at each draft position;
a draft that picks its tokens deterministically passes None for a one-hot q, handled without
materializing it. Memory beyond the inputs stays O(B·V): the one loop is over γ ≤ 8 positions.
"""

from __future__ import annotations

from typing import Literal

import torch

from m3serve.core.spec.verdict import Verdict, check_block, commit, prefix_len

Method = Literal["tokenwise", "block"]

_TINY = 1e-30  # a floor for divisors that are zero only where the quotient is discarded


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V] (rows need not be normalized), with no host sync.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks x with probability p(x) / Σp: the first arrival
    of independent Poisson clocks of rates p(x). A zero-probability token never wins.
    """
    clocks = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / clocks.clamp_min(_TINY), dim=-1)


class _Block:
    """One batch's verify inputs, with the per-slot views both rules need."""

    def __init__(
        self, draft: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None
    ) -> None:
        check_block(draft, target_probs)
        if draft_probs is not None and draft_probs.shape != (*draft.shape, target_probs.shape[2]):
            raise ValueError(
                f"draft_probs {tuple(draft_probs.shape)} must be [B, γ, V] = "
                f"[{draft.shape[0]}, {draft.shape[1]}, {target_probs.shape[2]}]"
            )
        self.draft = draft
        self.p = target_probs.float()
        self.q = None if draft_probs is None else draft_probs.float()
        self.gamma = draft.shape[1]
        self.rows = torch.arange(draft.shape[0], device=draft.device)

    def p_draft(self) -> torch.Tensor:
        """p_i(d_i) [B, γ]: the target's probability of each draft token."""
        return torch.gather(self.p[:, : self.gamma], 2, self.draft[..., None]).squeeze(2)

    def q_draft(self) -> torch.Tensor:
        """q_i(d_i) [B, γ]: the draft's probability of its own tokens."""
        if self.q is None:
            return torch.ones_like(self.draft, dtype=torch.float32)
        return torch.gather(self.q, 2, self.draft[..., None]).squeeze(2)

    def q_at(self, slot: torch.Tensor) -> torch.Tensor:
        """q [B, V] at each row's `slot` [B] (0..γ); zero at slot γ, where no draft was made."""
        inside = (slot < self.gamma)[:, None]
        clamped = slot.clamp_max(self.gamma - 1)
        if self.q is None:
            one_hot = torch.zeros_like(self.p[:, 0])
            one_hot.scatter_(1, self.draft[self.rows, clamped][:, None], 1.0)
            return one_hot * inside
        return self.q[self.rows, clamped] * inside

    def slot(self, i: int) -> torch.Tensor:
        """[B] int64 filled with slot `i`."""
        return torch.full_like(self.rows, i)


def _residual_draw(
    block: _Block, slot: torch.Tensor, scale: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """The correction/bonus token at `slot` [B]: a draw from norm(max(scale·p − q, 0)).

    q is zero at slot γ, so there this is a draw from p: the bonus. Where the residual has no
    mass (p = q up to rounding; a rejection there has probability 0) it falls back to p.
    """
    p = block.p[block.rows, slot]
    residual = (scale[:, None] * p - block.q_at(slot)).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return draw(torch.where(empty, p, residual), generator)


def _tokenwise(block: _Block, uniforms: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Per-token rejection (Leviathan et al. 2023): keep d_i with probability min(1, p/q) until
    the first rejection, resample there from norm(max(p − q, 0)); all kept ⇒ bonus from p.
    """
    # u < p/q without dividing: q(d) = 0 accepts (ratio ∞) unless p(d) = 0 too, and a draft
    # outside the target's support (p(d) = 0, e.g. cut by top-k/top-p) is always rejected.
    accept_len = prefix_len(uniforms * block.q_draft() < block.p_draft())
    ones = torch.ones_like(uniforms[:, 0])
    return commit(block.draft, accept_len, _residual_draw(block, accept_len, ones, generator))


def _joint_ratios(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """w [B, γ+1]: w_0 = 1, w_i = min(1, w_{i−1} · p_i(d_i) / q_i(d_i)).

    Written so that q(d) = 0 gives 1 (an infinite ratio) while w stays 0 once it is 0.
    """
    weights = [torch.ones_like(p_d[:, 0])]
    for i in range(p_d.shape[1]):
        num = weights[-1] * p_d[:, i]
        capped = (num > 0) & (num >= q_d[:, i])
        weights.append(torch.where(capped, 1.0, num / q_d[:, i].clamp_min(_TINY)))
    return torch.stack(weights, dim=1)


def _thresholds(block: _Block, weights: torch.Tensor) -> torch.Tensor:
    """h [B, γ]: h_i = r_i / (r_i + 1 − w_i) for i < γ, with r_i = Σ_x max(w_i·p_{i+1}(x) −
    q_{i+1}(x), 0) the residual mass one position ahead; h_γ = w_γ."""
    h = []
    for i in range(1, block.gamma):
        ahead = weights[:, i, None] * block.p[:, i] - block.q_at(block.slot(i))
        mass = ahead.clamp_min(0.0).sum(dim=-1)
        denom = mass + 1.0 - weights[:, i]
        # denom = 0 only when w_i = 1 and r_i = 0: stopping at i costs nothing, so h = 1.
        h.append(torch.where(denom > 0.0, mass / denom.clamp_min(_TINY), 1.0))
    h.append(weights[:, block.gamma])
    return torch.stack(h, dim=1)


def _block(block: _Block, uniforms: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Block verification (Sun et al. 2024, arXiv 2403.10444; vLLM's "block" method): with w
    and h as above and coins η, τ = the largest i with η_i < h_i (0 if none); keep d_1..d_τ,
    then draw from norm(max(w_τ·p_{τ+1} − q_{τ+1}, 0)) — the bonus from p when τ = γ.
    """
    weights = _joint_ratios(block.p_draft(), block.q_draft())
    h = _thresholds(block, weights)
    positions = torch.arange(1, block.gamma + 1, device=uniforms.device)
    accept_len = torch.where(uniforms < h, positions, 0).amax(dim=1)
    scale = torch.gather(weights, 1, accept_len[:, None]).squeeze(1)
    return commit(block.draft, accept_len, _residual_draw(block, accept_len, scale, generator))


def verify_sampled(
    draft: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    method: Method,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Verify sampled drafts so that the committed tokens are distributed as the target's.

    draft [B, γ] int64, each d_i drawn from draft_probs[:, i]; target_probs [B, γ+1, V] after
    temperature / top-k / top-p (rows sum to 1); draft_probs [B, γ, V] (None: the draft chose
    its tokens deterministically, q one-hot); uniforms [B, γ] in [0, 1), the acceptance coins
    (None: drawn from `generator`, which also draws the correction/bonus tokens).
    """
    block = _Block(draft, target_probs, draft_probs)
    if uniforms is None:
        uniforms = torch.rand(draft.shape, generator=generator, device=draft.device)
    if uniforms.shape != draft.shape:
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must match draft {tuple(draft.shape)}")
    if method == "tokenwise":
        return _tokenwise(block, uniforms.float(), generator)
    if method == "block":
        return _block(block, uniforms.float(), generator)
    raise ValueError(f"unknown verification method {method!r} (tokenwise or block)")
