"""Sampled verification's acceptance rules: tokenwise and block against plain-Python references
with fixed coins, the edge cases (q(d) = 0, p(d) = 0, an empty residual), and block
verification accepting more than tokenwise."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.spec.verify import PAD, Method, verify_sampled

from .markov import propose, random_chain

METHODS: tuple[Method, ...] = ("tokenwise", "block")
# The references compute in float64, the code in float32: a coin this close to its threshold
# may fall either way, so such a row is not compared (it happens about once in 10^5 coins).
_NEAR = 1e-5


def _tokenwise_reference(p: list[float], q: list[float], u: list[float]) -> int | None:
    """Drafts kept: stop at the first i with u_i >= p_i(d_i) / q_i(d_i)."""
    kept = 0
    for p_d, q_d, coin in zip(p, q, u, strict=True):
        if abs(coin * q_d - p_d) < _NEAR:
            return None
        if not coin * q_d < p_d:
            break
        kept += 1
    return kept


def _block_reference(
    p_d: list[float],
    q_d: list[float],
    p_next: list[list[float]],
    q_next: list[list[float]],
    u: list[float],
) -> int | None:
    """τ of block verification, written out from Sun et al. 2024 one position at a time."""
    gamma = len(p_d)
    weight, tau = 1.0, 0
    for i in range(gamma):
        num = weight * p_d[i]
        weight = 0.0 if num == 0 else 1.0 if q_d[i] == 0 else min(1.0, num / q_d[i])
        if i == gamma - 1:
            h = weight
        else:
            mass = sum(max(weight * a - b, 0.0) for a, b in zip(p_next[i], q_next[i], strict=True))
            denom = mass + 1.0 - weight
            h = mass / denom if denom > 0 else 1.0
        if abs(u[i] - h) < _NEAR:
            return None
        if u[i] < h:
            tau = i + 1
    return tau


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, ...]:
    rows, gamma, vocab = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(2, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    target = random_chain(vocab, gen, keep=draw(st.sampled_from([None, max(1, vocab - 2)])))
    block = propose(target, random_chain(vocab, gen), rows, gamma, gen)
    uniforms = torch.rand(rows, gamma, generator=gen)
    return (*block, uniforms)


@settings(max_examples=100, deadline=None)
@given(_cases())
def test_accept_lengths_match_plain_python_references(case: tuple[torch.Tensor, ...]) -> None:
    draft, target_probs, draft_probs, uniforms = case
    gen = torch.Generator().manual_seed(0)
    tokenwise = verify_sampled(draft, target_probs, draft_probs, uniforms, "tokenwise", gen)
    block = verify_sampled(draft, target_probs, draft_probs, uniforms, "block", gen)
    gamma = draft.shape[1]
    for b in range(draft.shape[0]):
        d = draft[b].tolist()
        p_d = [float(target_probs[b, i, d[i]]) for i in range(gamma)]
        q_d = [float(draft_probs[b, i, d[i]]) for i in range(gamma)]
        p_next = target_probs[b, 1:gamma].tolist()
        q_next = draft_probs[b, 1:gamma].tolist()
        coins = uniforms[b].tolist()
        want_tokenwise = _tokenwise_reference(p_d, q_d, coins)
        if want_tokenwise is not None:
            assert int(tokenwise.accept_len[b]) == want_tokenwise
        want_block = _block_reference(p_d, q_d, p_next, q_next, coins)
        if want_block is not None:
            assert int(block.accept_len[b]) == want_block
        for verdict in (tokenwise, block):
            kept = int(verdict.accept_len[b])
            assert verdict.tokens[b, :kept].tolist() == d[:kept]
            assert all(t == PAD for t in verdict.tokens[b, kept + 1 :].tolist())
            # The correction/bonus token lies in the target's support at its slot.
            assert float(target_probs[b, kept, int(verdict.tokens[b, kept])]) > 0


def test_draft_the_draft_could_not_propose_is_accepted_when_the_target_allows_it() -> None:
    """q(d) = 0 (the ratio p/q is infinite) accepts; both rules agree."""
    target = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    draft_probs = torch.tensor([[[1.0, 0.0]]])
    for method in METHODS:
        coin = torch.tensor([[0.99]])
        verdict = verify_sampled(torch.tensor([[1]]), target, draft_probs, coin, method)
        assert verdict.accept_len.tolist() == [1]


def test_draft_outside_target_support_is_always_rejected() -> None:
    """p(d) = 0 (cut by top-k / top-p) rejects even with a zero coin."""
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.4, 0.4]]])
    draft_probs = torch.tensor([[[0.9, 0.1, 0.0]]])
    for method in METHODS:
        coin = torch.zeros(1, 1)
        verdict = verify_sampled(torch.tensor([[0]]), target, draft_probs, coin, method)
        assert verdict.accept_len.tolist() == [0]
        assert verdict.tokens.tolist() == [[1, PAD]]  # the only token the target allows


def test_empty_residual_falls_back_to_target() -> None:
    """p = q leaves no residual mass; a forced rejection (coin 1) must still draw from p."""
    rows = 256
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    target = p.expand(rows, 2, 4).clone()
    draft_probs = p.expand(rows, 1, 4).clone()
    draft = torch.full((rows, 1), 1)
    gen = torch.Generator().manual_seed(5)
    verdict = verify_sampled(draft, target, draft_probs, torch.ones(rows, 1), "tokenwise", gen)
    assert verdict.accept_len.eq(0).all()
    first = verdict.tokens[:, 0]
    assert ((first == 1) | (first == 2)).all()
    assert (first == 1).any() and (first == 2).any()


def test_block_accepts_at_least_as_many_as_tokenwise_on_same_draws() -> None:
    gen = torch.Generator().manual_seed(7)
    rows, gamma = 20_000, 4
    target = random_chain(6, gen)
    block = propose(target, random_chain(6, gen), rows, gamma, gen)
    uniforms = torch.rand(rows, gamma, generator=gen)
    tokenwise = verify_sampled(*block, uniforms, "tokenwise", gen)
    blockwise = verify_sampled(*block, uniforms, "block", gen)
    assert blockwise.accept_len.float().mean() >= tokenwise.accept_len.float().mean()


def test_block_accepts_strictly_more_when_a_later_ratio_makes_up_for_an_earlier_one() -> None:
    """p(x1) = [.5, .5], q(x1) = [1, 0]: d1 = 0 with ratio 1/2. Then p(x2 | 0) = [1, 0] and
    q(x2 | 0) = [.5, .5]: d2 = 0 has ratio 2. Tokenwise keeps d1 half the time (expected
    length (1 + 1/2) / 2 = 3/4); block sees the joint ratio 1/2 · 2 = 1 and keeps both
    whenever d2 = 0 and nothing otherwise (expected 1) — and the first token stays 50/50."""
    rows = 20_000
    gen = torch.Generator().manual_seed(11)
    second = torch.randint(0, 2, (rows,), generator=gen)
    draft = torch.stack([torch.zeros_like(second), second], dim=1)
    target = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.5, 0.5]]).expand(rows, 3, 2).clone()
    draft_probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]]).expand(rows, 2, 2).clone()
    uniforms = torch.rand(rows, 2, generator=gen)
    tokenwise = verify_sampled(draft, target, draft_probs, uniforms, "tokenwise", gen)
    blockwise = verify_sampled(draft, target, draft_probs, uniforms, "block", gen)
    assert abs(tokenwise.accept_len.float().mean().item() - 0.75) < 0.03
    assert abs(blockwise.accept_len.float().mean().item() - 1.0) < 0.03
    assert torch.equal(blockwise.accept_len, 2 * (second == 0).long())
    assert abs(blockwise.tokens[:, 0].float().mean().item() - 0.5) < 0.03


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_one_hot_draft_none_equals_explicit_one_hot_probs(case: tuple[torch.Tensor, ...]) -> None:
    """draft_probs=None (never materialized) is exactly an explicit one-hot q."""
    draft, target_probs, _, uniforms = case
    one_hot = torch.nn.functional.one_hot(draft, target_probs.shape[2]).float()
    for method in METHODS:
        implicit = verify_sampled(
            draft, target_probs, None, uniforms, method, torch.Generator().manual_seed(4)
        )
        explicit = verify_sampled(
            draft, target_probs, one_hot, uniforms, method, torch.Generator().manual_seed(4)
        )
        assert torch.equal(implicit.accept_len, explicit.accept_len)
        assert torch.equal(implicit.tokens, explicit.tokens)
