"""What the sampler returns besides tokens (logprobs) and what a grammar bitmask lets it pick."""

from __future__ import annotations

import pytest
import torch

from m3serve.core.sampler import Sampler

from .sampler_cases import CPU, VOCAB, new_sampler, params, request_logits

# -------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_sorted_top_lists() -> None:
    vocab = 10
    sampler = new_sampler(vocab=vocab)
    batch = [
        params(temperature=0.0, logprobs=True, top_logprobs=3, repetition_penalty=1.8),
        params(temperature=0.5, logprobs=True, top_logprobs=0, frequency_penalty=1.5, seed=1),
        params(temperature=1.3, top_k=4),  # no logprobs
        params(temperature=1.0, logprobs=True, top_logprobs=20),  # more than the vocab
    ]
    slots = [5, 1, 7, 0]
    for slot, p in zip(slots, batch, strict=True):
        sampler.start(slot, p, [0, 1, 2])
    for step in range(4):
        logits = torch.stack([request_logits(i, step, vocab) for i in range(4)])
        tokens, logprobs = sampler.sample(logits, slots)
        raw = torch.log_softmax(logits, dim=-1)
        assert logprobs[2] is None
        for row, want_len in [(0, 3), (1, 0), (3, vocab)]:
            entry = logprobs[row]
            assert entry is not None
            assert entry.token_id == tokens[row].item()
            assert entry.logprob == pytest.approx(raw[row, entry.token_id].item(), abs=1e-6)
            assert len(entry.top) == want_len
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
            for token, value in entry.top:
                assert value == pytest.approx(raw[row, token].item(), abs=1e-6)
            if want_len:
                assert entry.top[0][1] == pytest.approx(raw[row].max().item(), abs=1e-6)


def test_logprob_ids_stay_exact_in_a_large_vocab() -> None:
    vocab = (1 << 24) + 8  # float32 cannot hold every id here
    sampler = Sampler(1, vocab, CPU, seed=0)
    sampler.start(0, params(temperature=0.0, logprobs=True, top_logprobs=2), [])
    logits = torch.zeros(1, vocab)
    logits[0, vocab - 1] = 5.0
    logits[0, vocab - 3] = 4.0
    _, (entry,) = sampler.sample(logits, [0])
    assert entry is not None
    assert entry.token_id == vocab - 1
    assert [t for t, _ in entry.top] == [vocab - 1, vocab - 3]


# ---------------------------------------------------------------------- grammar bitmask


def packed(allowed: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    """The packed int32 bitmask (xgrammar's layout) allowing `allowed[i]` in row i."""
    bits = torch.zeros(len(allowed), -(-vocab // 32) * 32, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        bits[row, list(ids)] = 1
    words = (bits.view(len(allowed), -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def test_a_masked_token_is_never_sampled() -> None:
    sampler = new_sampler()
    allowed = {3, 17, VOCAB - 1}
    for slot in range(4):
        sampler.start(slot, params(temperature=1.5, seed=slot), [])
    logits = torch.randn(4, VOCAB) * 4
    logits[:, 0] = 50.0  # by far the likeliest token, and masked
    bitmask = packed([allowed] * 4)
    for _ in range(50):
        tokens, _ = sampler.sample(logits, [0, 1, 2, 3], bitmask)
        assert set(tokens.tolist()) <= allowed


def test_greedy_picks_the_best_allowed_token_after_penalties() -> None:
    sampler = new_sampler()
    sampler.start(0, params(temperature=0.0, repetition_penalty=2.0), [9])
    sampler.start(1, params(temperature=0.0), [])
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 9], logits[:, 11] = 8.0, 6.0, 4.0
    tokens, _ = sampler.sample(logits, [0, 1], packed([{9, 11}, set(range(VOCAB))]))
    # Row 0: 5 is masked and 9 (seen in the prompt) halves to 3.0, below 11. Row 1: no mask.
    assert tokens.tolist() == [11, 5]
