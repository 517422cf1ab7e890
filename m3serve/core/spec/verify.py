"""Verification of a drafted block against the target's distributions at every block slot: the
one entry point for a batch mixing greedy and sampled rows, greedy argmax matching, and the
perf-only fixed-acceptance override. The sampled rules live in `rejection`.

The target ran one forward over [anchor, d_1..d_γ], so slot i of its output (i = 0..γ) is its
distribution for the token after position i: slot 0 judges d_1, slot γ gives the bonus token.
Every rule returns a `Verdict` and is batched over rows; no rule reads the device from the host.
"""

from __future__ import annotations

import math

import torch

from m3serve.core.spec.rejection import Method, draw, verify_sampled
from m3serve.core.spec.verdict import PAD, Verdict, check_block, commit, prefix_len

__all__ = [
    "PAD",
    "Method",
    "Verdict",
    "accept_length_override",
    "draw",
    "override_length",
    "verify",
    "verify_greedy",
    "verify_sampled",
]


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the longest draft prefix that matches the target's argmax, then emit the argmax at
    the first mismatch (or the bonus after γ matches): exactly what plain greedy decoding emits.

    draft [B, γ] int64; target_logits [B, γ+1, V] (any float dtype; only the argmax matters).
    """
    check_block(draft, target_logits)
    choice = torch.argmax(target_logits, dim=-1)  # [B, γ+1]
    accept_len = prefix_len(draft == choice[:, :-1])
    last = torch.gather(choice, 1, accept_len[:, None]).squeeze(1)
    return commit(draft, accept_len, last)


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


def override_length(mean: float, step: int) -> int:
    """The accept length of the `step`-th overridden verify step (0, 1, ...) for a mean of
    `mean`: floor((step + 1) · mean) − floor(step · mean), which is `mean` itself when it is
    whole and otherwise mixes its two nearest lengths so that every prefix of steps averages
    within one step of `mean` (3.07: a 4 every ~14 steps among 3s)."""
    if mean < 1:
        raise ValueError(f"accept length override must be ≥ 1 (got {mean})")
    return math.floor((step + 1) * mean) - math.floor(step * mean)


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
        check_block(draft, choice)
        choice = torch.argmax(choice, dim=-1)
    elif choice.shape != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(f"target tokens {tuple(choice.shape)} must be [B, γ+1]")
    kept = min(accept_length - 1, draft.shape[1])
    accept_len = torch.full((draft.shape[0],), kept, dtype=torch.int64, device=draft.device)
    return commit(draft, accept_len, choice[:, kept].to(torch.int64))
