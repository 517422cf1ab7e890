"""Greedy verification (the longest prefix matching the target's argmax, then its argmax), the
mixed greedy/sampled batch entry point, and the perf-only accept-length override."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.spec.verify import (
    PAD,
    accept_length_override,
    override_length,
    verify,
    verify_greedy,
    verify_sampled,
)

from .markov import propose, random_chain


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


def test_mixed_batch_takes_each_rows_own_rule() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, gamma, vocab = 64, 4, 5
    block = propose(random_chain(vocab, gen), random_chain(vocab, gen), rows, gamma, gen)
    logits = torch.log(block.target_probs)  # what the processed probs came from
    greedy = torch.arange(rows) % 3 == 0
    uniforms = torch.rand(rows, gamma, generator=gen)
    probs = (block.target_probs, block.draft_probs, uniforms)
    mixed = verify(block.draft, logits, greedy, *probs, "block", torch.Generator().manual_seed(8))
    alone_greedy = verify_greedy(block.draft, logits)
    alone_sampled = verify_sampled(
        *block, uniforms, "block", generator=torch.Generator().manual_seed(8)
    )
    for b in range(rows):
        want = alone_greedy if greedy[b] else alone_sampled
        assert int(mixed.accept_len[b]) == int(want.accept_len[b])
        assert mixed.tokens[b].tolist() == want.tokens[b].tolist()


def test_all_greedy_batch_needs_no_probabilities() -> None:
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(2))
    draft = logits[:, :3].argmax(-1)
    verdict = verify(draft, logits, torch.ones(3, dtype=torch.bool))
    assert verdict.accept_len.tolist() == [3, 3, 3]
    assert verdict.tokens[:, 3].tolist() == logits[:, 3].argmax(-1).tolist()


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 9])
def test_accept_length_override_keeps_exactly_l_minus_1_drafts(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    rows, gamma, vocab = 5, 4, 11
    draft = torch.randint(0, vocab, (rows, gamma), generator=gen)  # random: nothing matches
    logits = torch.randn(rows, gamma + 1, vocab, generator=gen)
    choice = logits.argmax(-1)
    kept = min(length - 1, gamma)
    for target in (logits, choice):
        verdict = accept_length_override(draft, target, length)
        assert verdict.accept_len.tolist() == [kept] * rows
        assert torch.equal(verdict.tokens[:, :kept], draft[:, :kept])
        assert torch.equal(verdict.tokens[:, kept], choice[:, kept])
        assert (verdict.tokens[:, kept + 1 :] == PAD).all()


def test_accept_length_override_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="≥ 1"):
        accept_length_override(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3), 0)


@given(mean=st.floats(1.0, 8.0), steps=st.integers(1, 400))
def test_override_lengths_average_the_mean_within_one_step(mean: float, steps: int) -> None:
    lengths = [override_length(mean, n) for n in range(steps)]
    assert set(lengths) <= {math.floor(mean), math.ceil(mean)}
    assert abs(sum(lengths) - steps * mean) < 1


def test_a_whole_override_length_is_constant() -> None:
    assert {override_length(5.0, n) for n in range(100)} == {5}
    assert sum(override_length(3.07, n) for n in range(100)) == 307
    with pytest.raises(ValueError):
        override_length(0.5, 0)
