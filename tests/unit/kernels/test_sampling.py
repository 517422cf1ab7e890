"""Single-request sampling (m3serve.kernels.sampling, through the generate loop's `next_token`):
greedy, seeds, top-k / top-p / min-p, frequencies.

Filters are checked deterministically on crafted distributions whose probabilities are exact
binary fractions; the sampler itself with fixed seeds (so every run draws the same tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from m3serve.kernels.sampling import filter_probs
from m3serve.model.generate import next_token
from m3serve.runtime.messages import SamplingParams


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> list[int]:
    gen = seeded(seed)
    return [next_token(logits, params, gen) for _ in range(n)]


def kept(probs: list[float], **kwargs: float) -> set[int]:
    out = filter_probs(torch.tensor(probs), **kwargs)
    return {i for i, p in enumerate(out.tolist()) if p > 0}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def counts_of(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


# -------------------------------------------------------------------------------- greedy


def test_greedy_returns_argmax() -> None:
    gen = seeded(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen)
        greedy = SamplingParams(temperature=0.0)
        assert next_token(logits, greedy, None) == int(torch.argmax(logits))


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingParams(temperature=0.0, top_p=0.5, top_k=10),
        SamplingParams(temperature=-1.0),
        SamplingParams(temperature=5.0, top_k=1),
    ],
)
def test_temperature_zero_or_top_k_one_is_greedy(cfg: SamplingParams) -> None:
    assert cfg.greedy
    logits = torch.randn(64, generator=seeded(1))
    assert set(draws(logits, cfg, 50, seed=2)) == {int(torch.argmax(logits))}


def test_positive_temperature_without_top_k_one_is_not_greedy() -> None:
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams(temperature=1.0, top_k=2).greedy


def test_greedy_does_not_consume_the_generator() -> None:
    gen = seeded(3)
    state = gen.get_state()
    next_token(torch.randn(10), SamplingParams(temperature=0.0), gen)
    assert torch.equal(gen.get_state(), state)


# ---------------------------------------------------------------------------------- seeds


def test_same_seed_gives_same_tokens() -> None:
    logits = torch.zeros(50)
    cfg = SamplingParams(temperature=1.0)
    assert draws(logits, cfg, 200, seed=7) == draws(logits, cfg, 200, seed=7)


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(50)
    cfg = SamplingParams(temperature=1.0)
    a, b = draws(logits, cfg, 200, seed=7), draws(logits, cfg, 200, seed=8)
    # Two independent uniform streams over 50 tokens agree on ~1/50 of the draws.
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 20


def test_a_seeded_stream_is_not_constant() -> None:
    tokens = draws(torch.zeros(50), SamplingParams(temperature=1.0), 200, seed=9)
    assert len(set(tokens)) > 30


# -------------------------------------------------------------------------------- filters


def test_top_k_keeps_exactly_the_k_most_likely_values_unchanged() -> None:
    probs = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    out = filter_probs(probs, top_k=3)
    assert {i for i, p in enumerate(out.tolist()) if p > 0} == {1, 3, 4}
    assert torch.equal(out[[1, 3, 4]], probs[[1, 3, 4]])


def test_top_k_at_least_vocab_size_keeps_everything() -> None:
    assert kept([0.5, 0.25, 0.25], top_k=3) == {0, 1, 2}
    assert kept([0.5, 0.25, 0.25], top_k=10) == {0, 1, 2}


def test_top_k_sampling_only_draws_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, 2.0, -1.0, 0.5, 1.5])
    tokens = draws(logits, SamplingParams(temperature=1.0, top_k=3), 600, seed=10)
    assert set(tokens) == {1, 3, 4}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.3, {0}),  # the top token alone already reaches p
        (0.45, {0}),
        (0.6, {0, 1}),
        (0.8, {0, 1, 2}),
        (0.99, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, expected: set[int]) -> None:
    # Sorted order differs from index order on purpose.
    probs = [0.5, 0.25, 0.1875, 0.0625]
    perm = [2, 0, 3, 1]
    shuffled = [probs[i] for i in perm]
    assert {perm[i] for i in kept(shuffled, top_p=top_p)} == expected


def test_top_p_prefix_exactly_reaching_p_stops_there() -> None:
    # 0.5 + 0.25 == 0.75 exactly (binary fractions): the smallest prefix reaching p = 0.75 is
    # {0, 1}; the next token's preceding mass equals p, so it must be dropped (HF's and vLLM's
    # top-p drop it too). filter_probs drops only when the preceding mass is *greater* than p.
    assert kept([0.5, 0.25, 0.1875, 0.0625], top_p=0.75) == {0, 1}


def test_top_p_after_top_k_is_relative_to_the_remaining_mass() -> None:
    # top-k 2 keeps {0.4, 0.3}; of their 0.7, top-p 0.5 needs only the first (0.4 / 0.7 > 0.5).
    assert kept([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5) == {0}
    assert kept([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.6) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max_prob() -> None:
    probs = [0.5, 0.25, 0.125, 0.0625, 0.0625]
    assert kept(probs, min_p=0.2) == {0, 1, 2}  # threshold 0.1
    assert kept(probs, min_p=0.5) == {0, 1}  # threshold 0.25 keeps the token equal to it
    assert kept(probs, min_p=1.0) == {0}


def test_min_p_sampling_never_draws_dropped_tokens() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    tokens = draws(logits, SamplingParams(temperature=1.0, min_p=0.2), 500, seed=11)
    assert set(tokens) == {0, 1, 2}


def test_disabled_filters_keep_every_token() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    assert torch.equal(filter_probs(probs), probs)


# ---------------------------------------------------------------------------- frequencies

# chi-square critical values at p = 1e-4 (a fixed seed makes the outcome deterministic anyway).
CHI2_CRIT = {2: 18.4, 4: 23.5}


def test_sampling_frequencies_match_softmax_of_logits() -> None:
    target = [0.4, 0.25, 0.2, 0.1, 0.05]
    logits = torch.log(torch.tensor(target)) + 3.0  # softmax is shift invariant
    tokens = draws(logits, SamplingParams(temperature=1.0), 6000, seed=12)
    assert chi_square(counts_of(tokens, 5), target) < CHI2_CRIT[4]


def test_temperature_scales_logits_before_sampling() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
    target = torch.softmax(logits / 2.0, dim=-1).tolist()
    tokens = draws(logits, SamplingParams(temperature=2.0), 6000, seed=13)
    counts = counts_of(tokens, 5)
    assert chi_square(counts, target) < CHI2_CRIT[4]
    untempered = torch.softmax(logits, dim=-1).tolist()
    assert chi_square(counts, untempered) > 10 * CHI2_CRIT[4]


def test_filtered_sampling_follows_renormalized_distribution() -> None:
    probs = [0.35, 0.3, 0.15, 0.1, 0.1]
    logits = torch.log(torch.tensor(probs))
    tokens = draws(logits, SamplingParams(temperature=1.0, top_k=3), 6000, seed=14)
    counts = counts_of(tokens, 5)
    assert counts[3] == counts[4] == 0
    renorm = [p / 0.8 for p in probs[:3]]
    assert chi_square(counts[:3], renorm) < CHI2_CRIT[2]


def test_rare_token_probability_is_respected() -> None:
    # One token with p = 1 / 64 among a near-certain one: its count stays near n / 64.
    logits = torch.tensor([math.log(63.0), 0.0])
    tokens = draws(logits, SamplingParams(temperature=1.0), 6400, seed=15)
    rare = tokens.count(1)
    assert 100 - 4 * 10 < rare < 100 + 4 * 10  # mean 100, sd ~ 9.9
