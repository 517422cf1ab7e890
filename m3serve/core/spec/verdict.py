"""The result of verifying a drafted block, and the pieces every verification rule shares.

The target ran one forward over [anchor, d_1..d_γ], so slot i of its output (i = 0..γ) is its
distribution for the token after position i: slot 0 judges d_1, slot γ gives the bonus token.
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


def check_block(draft: torch.Tensor, target: torch.Tensor) -> None:
    """Raise unless draft is [B, γ] and the target's per-slot tensor is [B, γ+1, V]."""
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
    return Verdict(accept_len.to(torch.int64), tokens.to(torch.int64))
