"""Sampled verification preserves the target's distribution: chi-square tests on a tiny Markov
target with a different draft, over many seeded rows in one batched call."""

from __future__ import annotations

import pytest
import torch

from m3serve.core.spec.verify import Method, verify_sampled

from .markov import (
    counts,
    direct,
    first_two,
    fit_p_value,
    joint,
    propose,
    random_chain,
    same_p_value,
)

VOCAB = 6
GAMMA = 3
ROWS = 40_000
ALPHA = 1e-3  # the seeds are fixed, so a pass is a pass every run


@pytest.mark.parametrize("method", ["tokenwise", "block"])
@pytest.mark.parametrize("keep", [None, 4], ids=["full-support", "top4-target"])
def test_sampled_verification_keeps_first_two_token_distribution(
    method: Method, keep: int | None
) -> None:
    gen = torch.Generator().manual_seed(1234)
    target = random_chain(VOCAB, gen, keep=keep)
    draft = random_chain(VOCAB, gen)  # full support: it proposes tokens the target cut
    block = propose(target, draft, ROWS, GAMMA, gen)
    verdict = verify_sampled(*block, uniforms=None, method=method, generator=gen)
    spec_on = first_two(verdict, target, gen)
    spec_off = direct(target, ROWS, gen)

    first_on = torch.bincount(spec_on[:, 0], minlength=VOCAB)
    first_off = torch.bincount(spec_off[:, 0], minlength=VOCAB)
    assert fit_p_value(first_on, target.start) > ALPHA
    assert fit_p_value(first_off, target.start) > ALPHA
    assert same_p_value(first_on, first_off) > ALPHA

    pairs_on, pairs_off = counts(spec_on, VOCAB), counts(spec_off, VOCAB)
    assert fit_p_value(pairs_on, joint(target)) > ALPHA
    assert same_p_value(pairs_on, pairs_off) > ALPHA
    # The test has teeth: some drafts were kept and some rejected.
    assert 0 < int((verdict.accept_len == 0).sum()) < ROWS
    assert int((verdict.accept_len >= 2).sum()) > 0


@pytest.mark.parametrize("method", ["tokenwise", "block"])
@pytest.mark.parametrize("gamma", [1, GAMMA])  # γ = 1: the second token is often the bonus
def test_one_hot_draft_keeps_distribution(method: Method, gamma: int) -> None:
    """A draft that picks its tokens deterministically (q one-hot, draft_probs=None) is
    verified losslessly too: acceptance is then p(d), the residual p without d."""
    gen = torch.Generator().manual_seed(99)
    target = random_chain(VOCAB, gen, keep=4)
    block = propose(target, random_chain(VOCAB, gen), ROWS, gamma, gen)
    verdict = verify_sampled(block.draft, block.target_probs, None, None, method, generator=gen)
    spec_on = first_two(verdict, target, gen)
    assert fit_p_value(torch.bincount(spec_on[:, 0], minlength=VOCAB), target.start) > ALPHA
    assert fit_p_value(counts(spec_on, VOCAB), joint(target)) > ALPHA
    assert 0 < int((verdict.accept_len == 0).sum()) < ROWS
