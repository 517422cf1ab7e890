"""A tiny random Markov "model" pair (target p, draft q) and chi-square tests, for checking that
speculative verification leaves the target's distribution unchanged.

Each position's distribution depends on the previous token only, so slot i of the target's
verify output is P[d_i] (slot 0: p0), and the draft drew d_{i+1} from Q[d_i] (d_1 from q0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from m3serve.core.spec.verify import Verdict, draw


class Chain(NamedTuple):
    """A first-order Markov distribution: start [V] and transition [V, V] (rows sum to 1)."""

    start: torch.Tensor
    step: torch.Tensor


class Block(NamedTuple):
    """One batched verify input: the drafts and both sides' distributions at every slot."""

    draft: torch.Tensor  # [N, γ]
    target_probs: torch.Tensor  # [N, γ+1, V]
    draft_probs: torch.Tensor  # [N, γ, V]


def random_chain(vocab: int, gen: torch.Generator, keep: int | None = None) -> Chain:
    """A random chain; `keep` cuts every distribution to its `keep` likeliest tokens (top-k)."""
    logits = torch.randn(vocab + 1, vocab, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    if keep is not None:
        cut = probs.topk(vocab - keep, dim=-1, largest=False).indices
        probs = probs.scatter(1, cut, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return Chain(probs[0], probs[1:])


def propose(target: Chain, draft: Chain, rows: int, gamma: int, gen: torch.Generator) -> Block:
    """`rows` independent draft blocks sampled from `draft`, with both chains' distributions."""
    q_slots = [draft.start.expand(rows, -1)]
    tokens = [draw(q_slots[0], gen)]
    for _ in range(gamma - 1):
        q_slots.append(draft.step[tokens[-1]])
        tokens.append(draw(q_slots[-1], gen))
    drafts = torch.stack(tokens, dim=1)
    p_slots = [target.start.expand(rows, -1)] + [target.step[drafts[:, i]] for i in range(gamma)]
    return Block(drafts, torch.stack(p_slots, dim=1), torch.stack(q_slots, dim=1))


def first_two(verdict: Verdict, target: Chain, gen: torch.Generator) -> torch.Tensor:
    """[N, 2]: the first two committed tokens; a row that kept no draft committed one token, so
    its second comes from the target's next step (a plain draw from P[x_1])."""
    first = verdict.tokens[:, 0]
    follow = draw(target.step[first], gen)
    second = torch.where(verdict.accept_len >= 1, verdict.tokens[:, 1], follow)
    return torch.stack([first, second], dim=1)


def direct(target: Chain, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[N, 2]: the first two tokens sampled from the target without speculation."""
    first = draw(target.start.expand(rows, -1), gen)
    return torch.stack([first, draw(target.step[first], gen)], dim=1)


def joint(target: Chain) -> torch.Tensor:
    """The exact probability [V*V] of each first-two-token pair, flattened as x1*V + x2."""
    return (target.start[:, None] * target.step).flatten()


def counts(pairs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V*V] counts of the pairs [N, 2]."""
    return torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)


def _p_value(stat: torch.Tensor, dof: int) -> float:
    """The chi-square upper tail P(X² ≥ stat) with `dof` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat.double() / 2.0))


def fit_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `observed` counts to `probs`; cells with probability 0 must be empty."""
    support = probs > 0
    assert int(observed[~support].sum()) == 0, "a token outside the target's support came out"
    expected = probs[support].double() * observed.sum()
    stat = ((observed[support] - expected) ** 2 / expected).sum()
    return _p_value(stat, int(support.sum()) - 1)


def same_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Homogeneity of two count vectors (a 2 x k contingency table): are they one distribution?"""
    used = (a + b) > 0
    table = torch.stack([a[used], b[used]]).double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return _p_value(stat, int(used.sum()) - 1)
