"""Greedy verification: the longest prefix matching the target's argmax, then its argmax."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.spec.verify import PAD, verify_greedy


def _reference(draft: list[int], choice: list[int]) -> tuple[int, list[int]]:
    """Plain-Python greedy verification of one row against the target's argmax per slot."""
    out: list[int] = []
    for i, token in enumerate(draft):
        if token != choice[i]:
            break
        out.append(token)
    accepted = len(out)
    out.append(choice[accepted])
    return accepted, out + [PAD] * (len(draft) + 1 - len(out))


@st.composite
def _batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    batch = draw(st.integers(1, 6))
    gamma = draw(st.integers(1, 8))
    vocab = draw(st.integers(2, 5))  # a small vocabulary, so that drafts often match
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, gamma + 1, vocab, generator=gen)
    choice = logits.argmax(-1)
    # Drafts that copy the target for a random prefix, then random tokens.
    draft = torch.randint(0, vocab, (batch, gamma), generator=gen)
    copy = torch.arange(gamma)[None, :] < torch.randint(0, gamma + 1, (batch, 1), generator=gen)
    draft = torch.where(copy, choice[:, :-1], draft)
    return draft, logits


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_greedy_matches_plain_python_reference(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    draft, logits = case
    verdict = verify_greedy(draft, logits)
    choice = logits.argmax(-1)
    for b in range(draft.shape[0]):
        accepted, tokens = _reference(draft[b].tolist(), choice[b].tolist())
        assert verdict.accept_len[b].item() == accepted
        assert verdict.tokens[b].tolist() == tokens
    assert verdict.accept_len.dtype == torch.int64
    assert verdict.tokens.dtype == torch.int64


def test_greedy_all_accepted_emits_bonus() -> None:
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]])
    verdict = verify_greedy(torch.tensor([[1, 2]]), logits)
    assert verdict.accept_len.tolist() == [2]
    assert verdict.tokens.tolist() == [[1, 2, 0]]


def test_greedy_first_mismatch_emits_target_choice() -> None:
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]])
    verdict = verify_greedy(torch.tensor([[0, 2]]), logits)
    assert verdict.accept_len.tolist() == [0]
    assert verdict.tokens.tolist() == [[1, PAD, PAD]]
