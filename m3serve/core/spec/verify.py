"""Verification of a drafted block against the target's distributions at every block slot.

The target ran one forward over [anchor, d_1..d_γ], so slot i of its output (i = 0..γ) is its
distribution for the token after position i: slot 0 judges d_1, slot γ gives the bonus token.
Each rule returns a `Verdict`: how many drafts a row keeps, and the tokens it commits (the kept
drafts, then one correction or bonus token). Every rule is batched over rows; the only loop is
over the γ ≤ 8 draft positions.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

PAD = -1  # token slots past a row's correction/bonus token


class Verdict(NamedTuple):
    """The outcome of verifying a batch of drafted blocks."""

    accept_len: torch.Tensor  # [B] int64: draft tokens accepted, 0..γ
    # [B, γ+1] int64: tokens[b, :accept_len[b]] are the accepted drafts, tokens[b, accept_len[b]]
    # the correction or bonus token, later entries PAD.
    tokens: torch.Tensor


def _check_shapes(draft: torch.Tensor, target: torch.Tensor) -> None:
    if draft.dim() != 2 or target.dim() != 3:
        raise ValueError(f"draft {tuple(draft.shape)} must be [B, γ], target [B, γ+1, V]")
    if target.shape[:2] != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(
            f"target {tuple(target.shape)} does not match draft {tuple(draft.shape)}: "
            "it needs γ+1 slots per row"
        )


def prefix_len(matches: torch.Tensor) -> torch.Tensor:
    """[B] int64: the length of each row's leading run of True in `matches` [B, γ]."""
    return torch.cumprod(matches.to(torch.int64), dim=1).sum(dim=1)


def commit(draft: torch.Tensor, accept_len: torch.Tensor, last: torch.Tensor) -> Verdict:
    """The Verdict for rows that keep `accept_len` drafts and then emit `last` [B]."""
    batch, gamma = draft.shape
    slots = torch.arange(gamma + 1, device=draft.device).expand(batch, gamma + 1)
    padded = torch.cat([draft, draft.new_full((batch, 1), PAD)], dim=1)
    tokens = torch.where(slots < accept_len[:, None], padded, PAD)
    tokens = torch.where(slots == accept_len[:, None], last[:, None], tokens)
    return Verdict(accept_len, tokens)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the longest draft prefix that matches the target's argmax, then emit the argmax at
    the first mismatch (or the bonus after γ matches): exactly what plain greedy decoding emits.

    draft [B, γ] int64; target_logits [B, γ+1, V] (any float dtype; only the argmax matters).
    """
    _check_shapes(draft, target_logits)
    choice = torch.argmax(target_logits, dim=-1)  # [B, γ+1]
    accept_len = prefix_len(draft == choice[:, :-1])
    last = torch.gather(choice, 1, accept_len[:, None]).squeeze(1)
    return commit(draft, accept_len, last)


# --------------------------------------------------------------------------- sampled rules

Method = Literal["tokenwise", "block"]

_TINY = 1e-30  # a floor for divisors that are zero only where the quotient is discarded


def _check_sampled(
    draft: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor
) -> None:
    _check_shapes(draft, target_probs)
    if draft_probs.shape != (draft.shape[0], draft.shape[1], target_probs.shape[2]):
        raise ValueError(
            f"draft_probs {tuple(draft_probs.shape)} must be [B, γ, V] = "
            f"[{draft.shape[0]}, {draft.shape[1]}, {target_probs.shape[2]}]"
        )


def one_hot_draft(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """q [B, γ, V] for a draft that proposed its tokens deterministically (argmax drafting)."""
    q = torch.zeros(*draft.shape, vocab, dtype=torch.float32, device=draft.device)
    return q.scatter_(2, draft[..., None], 1.0)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V] (rows need not be normalized), with no host sync.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks x with probability p(x) / Σp: the first arrival
    of independent Poisson clocks of rates p(x). A zero-probability token never wins.
    """
    clocks = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / clocks.clamp_min(_TINY), dim=-1)


def _residual_draw(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    slot: torch.Tensor,
    scale: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The correction/bonus token at `slot` [B]: a draw from norm(max(scale·p − q, 0)).

    q is zero at slot γ, so there this is a draw from p: the bonus. Where the residual has no
    mass (p = q up to rounding; a rejection there has probability 0) it falls back to p.
    """
    rows = torch.arange(slot.shape[0], device=slot.device)
    p = target_probs[rows, slot]
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (scale[:, None] * p - q_padded[rows, slot]).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return draw(torch.where(empty, p, residual), generator)


def _gather_draft(probs: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """probs[b, i, draft[b, i]] for the first γ slots: [B, γ]."""
    return torch.gather(probs[:, : draft.shape[1]], 2, draft[..., None]).squeeze(2)


def _tokenwise(
    draft: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Per-token rejection (Leviathan et al. 2023): keep d_i with probability min(1, p/q) until
    the first rejection, resample there from norm(max(p − q, 0)); all kept ⇒ bonus from p.
    """
    p_d = _gather_draft(target_probs, draft)
    q_d = _gather_draft(draft_probs, draft)
    # u < p/q without dividing: q(d) = 0 accepts (ratio ∞) unless p(d) = 0 too, and a draft
    # outside the target's support (p(d) = 0, e.g. cut by top-k/top-p) is always rejected.
    accept_len = prefix_len(uniforms * q_d < p_d)
    ones = torch.ones_like(p_d[:, 0])
    last = _residual_draw(target_probs, draft_probs, accept_len, ones, generator)
    return commit(draft, accept_len, last)


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


def _block(
    draft: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Block verification (Sun et al. 2024, arXiv 2403.10444; as vLLM's "block" method).

    With w_i the capped cumulative ratio, r_i = Σ_x max(w_i·p_{i+1}(x) − q_{i+1}(x), 0) the
    residual mass one position ahead, h_i = r_i / (r_i + 1 − w_i) for i < γ and h_γ = w_γ:
    τ = the largest i with η_i < h_i (0 if none); keep d_1..d_τ, then draw from
    norm(max(w_τ·p_{τ+1} − q_{τ+1}, 0)) — the bonus from p when τ = γ.
    """
    gamma = draft.shape[1]
    weights = _joint_ratios(_gather_draft(target_probs, draft), _gather_draft(draft_probs, draft))
    ahead = weights[:, 1:gamma, None] * target_probs[:, 1:gamma] - draft_probs[:, 1:gamma]
    mass = ahead.clamp_min(0.0).sum(dim=-1)  # [B, γ−1]: r_1..r_{γ−1}
    denom = mass + 1.0 - weights[:, 1:gamma]
    # denom = 0 only when w_i = 1 and r_i = 0: nothing would make τ = i worse, so h = 1.
    h_inner = torch.where(denom > 0.0, mass / denom.clamp_min(_TINY), 1.0)
    h = torch.cat([h_inner, weights[:, gamma:]], dim=1)  # [B, γ]
    positions = torch.arange(1, gamma + 1, device=draft.device)
    accept_len = torch.where(uniforms < h, positions, 0).amax(dim=1)
    scale = torch.gather(weights, 1, accept_len[:, None]).squeeze(1)
    last = _residual_draw(target_probs, draft_probs, accept_len, scale, generator)
    return commit(draft, accept_len, last)


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
    if draft_probs is None:
        draft_probs = one_hot_draft(draft, target_probs.shape[2])
    _check_sampled(draft, target_probs, draft_probs)
    target_probs = target_probs.float()
    draft_probs = draft_probs.float()
    if uniforms is None:
        uniforms = torch.rand(draft.shape, generator=generator, device=draft.device)
    if uniforms.shape != draft.shape:
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must match draft {tuple(draft.shape)}")
    if method == "tokenwise":
        return _tokenwise(draft, target_probs, draft_probs, uniforms.float(), generator)
    if method == "block":
        return _block(draft, target_probs, draft_probs, uniforms.float(), generator)
    raise ValueError(f"unknown verification method {method!r} (tokenwise or block)")


def verify(
    draft: torch.Tensor,
    target_logits: torch.Tensor,
    greedy: torch.Tensor,
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    method: Method = "tokenwise",
    generator: torch.Generator | None = None,
) -> Verdict:
    """Verify a mixed batch: rows where `greedy` [B] bool is set (temperature 0) by argmax
    matching on `target_logits`, the others by `verify_sampled` on the processed probabilities.

    Both rules run on the whole batch and each row takes its own rule's verdict, so nothing
    reads the device from the host. `target_probs` may be None only if every row is greedy;
    the sampled rule's values on greedy rows (whatever their probs hold) are discarded.
    """
    greedy_verdict = verify_greedy(draft, target_logits)
    if target_probs is None:
        return greedy_verdict
    sampled = verify_sampled(draft, target_probs, draft_probs, uniforms, method, generator)
    rows = greedy.to(device=draft.device, dtype=torch.bool)
    return Verdict(
        torch.where(rows, greedy_verdict.accept_len, sampled.accept_len),
        torch.where(rows[:, None], greedy_verdict.tokens, sampled.tokens),
    )


# ------------------------------------------------------------------------ benchmark only


def accept_length_override(
    draft: torch.Tensor, target_tokens_or_logits: torch.Tensor, accept_length: int
) -> Verdict:
    """PERF ONLY (`--speculative-accept-length-override L`): keep exactly min(L − 1, γ) drafts
    whatever they are, then the target's own token at that slot. The output is NOT the
    target's distribution; it exists to time speculation at a fixed acceptance length.

    target_tokens_or_logits: the target's chosen tokens [B, γ+1] (int) or logits [B, γ+1, V]
    (their argmax is the choice).
    """
    if accept_length < 1:
        raise ValueError(f"accept length override must be ≥ 1 (got {accept_length})")
    choice = target_tokens_or_logits
    if choice.dim() == 3:
        _check_shapes(draft, choice)
        choice = torch.argmax(choice, dim=-1)
    elif choice.shape != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(f"target tokens {tuple(choice.shape)} must be [B, γ+1]")
    kept = min(accept_length - 1, draft.shape[1])
    accept_len = torch.full((draft.shape[0],), kept, dtype=torch.int64, device=draft.device)
    return commit(draft, accept_len, choice[:, kept].to(torch.int64))
