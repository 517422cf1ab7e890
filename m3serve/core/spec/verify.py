"""Verification of a drafted block against the target's distributions at every block slot.

The target ran one forward over [anchor, d_1..d_γ], so slot i of its output (i = 0..γ) is its
distribution for the token after position i: slot 0 judges d_1, slot γ gives the bonus token.
Each rule returns a `Verdict`: how many drafts a row keeps, and the tokens it commits (the kept
drafts, then one correction or bonus token). Every rule is batched over rows; the only loop is
over the γ ≤ 8 draft positions.
"""

from __future__ import annotations

from typing import NamedTuple

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
