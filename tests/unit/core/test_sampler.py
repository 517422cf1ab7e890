"""The engine's batched sampler (m3serve.core.sampler.Sampler).

Penalties are checked against a per-row reference written in plain Python; batch invariance by
running each request alone and then inside shuffled batches; filters by necessary conditions
that do not depend on how ties are broken; frequencies with fixed seeds (every run draws the same
tokens, so the chi-square bounds cannot flake).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.sampler import Sampler
from m3serve.kernels.sampling import draw_token, filter_probs, filter_probs_batch
from m3serve.runtime.messages import SamplingParams

VOCAB = 48
CPU = torch.device("cpu")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**kwargs)


def new_sampler(max_slots: int = 8, vocab: int = VOCAB, device: torch.device = CPU) -> Sampler:
    return Sampler(max_slots, vocab, device, seed=1234)


def request_logits(request: int, step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits [V] that belong to one request and step, whatever batch they end up in."""
    gen = torch.Generator().manual_seed(1_000 * request + step)
    return 3.0 * torch.randn(vocab, generator=gen)


def forcing(tokens: Sequence[int], vocab: int = VOCAB) -> torch.Tensor:
    """Logits [B, V] under which every sampler configuration picks tokens[i] for row i: a
    100-logit lead survives any penalty and leaves other tokens e^-100 of the mass."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return logits


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@contextmanager
def host_reads_forbidden(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail on any Python-level read of a tensor's values (each one syncs on a GPU)."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sampler read a device value on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    yield
    monkeypatch.undo()


# ---------------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    sampler = new_sampler()
    greedy = [params(temperature=0.0), params(temperature=0.8, top_k=1), params(temperature=0.0)]
    for slot, p in enumerate(greedy):
        sampler.start(slot, p, [1, 2, 3])
    for step in range(5):
        logits = torch.stack([request_logits(slot, step) for slot in range(3)])
        tokens, logprobs = sampler.sample(logits, [0, 1, 2])
        assert tokens.dtype == torch.int64
        assert tokens.device == CPU
        assert torch.equal(tokens, torch.argmax(logits, dim=-1))
        assert logprobs == [None, None, None]


def test_a_vanishing_temperature_samples_the_argmax_not_nan() -> None:
    sampler = new_sampler()
    # A prompt may arrive as the numpy array the tokenizer sent.
    sampler.start(0, params(temperature=1e-30, seed=1), np.array([3, 4], dtype=np.int32))
    logits = 20.0 * torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens, _ = sampler.sample(logits, [0])
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))


def test_all_greedy_without_penalties_is_a_single_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = new_sampler()
    for slot in range(4):
        sampler.start(slot, params(temperature=0.0), [5])
    calls: list[str] = []

    def logged(name: str) -> Callable[..., Any]:
        real = getattr(torch, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("argmax", "softmax", "sort", "log_softmax", "topk"):
        monkeypatch.setattr(torch, name, logged(name))
    logits = torch.randn(4, VOCAB)
    tokens, _ = sampler.sample(logits, [3, 1, 0, 2])
    assert calls == ["argmax"]
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))


def test_no_host_reads_without_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Greedy, penalized and sampled rows together: no per-row .item() or any other sync point.
    sampler = new_sampler()
    batch = [
        params(temperature=0.0),
        params(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.3),
        params(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3),
        params(temperature=1.0),
    ]
    for slot, p in enumerate(batch):
        sampler.start(slot, p, [1, 2])
    logits = torch.randn(4, VOCAB)
    with host_reads_forbidden(monkeypatch):
        for _ in range(3):
            tokens, _ = sampler.sample(logits, [0, 1, 2, 3])
    assert tokens.shape == (4,)


# ------------------------------------------------------------------------------- penalties


def reference_penalties(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """One row, token by token, as the OpenAI / vLLM definitions read."""
    penalized = []
    for token, logit in enumerate(row):
        if token in prompt or token in output:
            r = p.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        count = output.count(token)
        logit -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        penalized.append(logit)
    return penalized


PENALIZED = [
    params(temperature=0.0, repetition_penalty=1.5),
    params(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25),
    params(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.0),
    params(temperature=0.7, top_p=0.9),  # no penalty: its row must come back untouched
]


def test_penalties_match_reference_per_row() -> None:
    vocab = 12
    sampler = new_sampler(max_slots=6, vocab=vocab)
    prompts = [[0, 1, 2], [1, 3, 3], [0, 4, 5], [2, 6]]
    outputs = [[7, 7, 1], [8, 3, 8], [9, 0, 9], [10, 11, 10]]
    slots = [4, 0, 2, 5]  # slots are not row indices
    for slot, p, prompt in zip(slots, PENALIZED, prompts, strict=True):
        sampler.start(slot, p, prompt)
    for step in range(3):
        tokens, _ = sampler.sample(forcing([out[step] for out in outputs], vocab), slots)
        assert tokens.tolist() == [out[step] for out in outputs]
    # Positive, negative and zero logits on prompt-only, output-only, both and unseen tokens.
    crafted = torch.tensor([[2.0, -1.5, 0.0, 3.0, -2.0, 1.0, 0.5, -0.5, 4.0, -3.0, 1.5, -1.0]] * 4)
    crafted += torch.arange(4).unsqueeze(1) * 0.25
    got = sampler.penalized(crafted, slots)
    for row in range(4):
        want = reference_penalties(
            crafted[row].tolist(), prompts[row], outputs[row], PENALIZED[row]
        )
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], crafted[3])


def test_presence_and_frequency_skip_prompt_tokens() -> None:
    sampler = new_sampler()
    sampler.start(0, params(frequency_penalty=2.0, presence_penalty=2.0), [1, 2, 3])
    assert torch.equal(sampler.penalized(torch.ones(1, VOCAB), [0]), torch.ones(1, VOCAB))


def test_counts_accumulate_across_steps_and_reset_on_start() -> None:
    sampler = new_sampler()
    penalty = params(temperature=0.0, frequency_penalty=1.0, repetition_penalty=2.0)
    sampler.start(3, penalty, [9])
    for token in [4, 4, 6, 4]:
        sampler.sample(forcing([token]), [3])
    got = sampler.penalized(torch.ones(1, VOCAB), [3])[0]
    assert got[4] == 0.5 - 3.0 and got[6] == 0.5 - 1.0 and got[9] == 0.5
    assert (got[[t for t in range(VOCAB) if t not in (4, 6, 9)]] == 1.0).all()
    sampler.start(3, penalty, [5])  # the slot's next request starts from its own prompt only
    got = sampler.penalized(torch.ones(1, VOCAB), [3])[0]
    assert got[5] == 0.5
    assert (got[[t for t in range(VOCAB) if t != 5]] == 1.0).all()


def test_frequency_penalty_steers_greedy_away_from_repeats() -> None:
    sampler = new_sampler()
    sampler.start(0, params(temperature=0.0, frequency_penalty=1.0), [])
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([2.0, 1.8, 1.6])
    tokens = [int(sampler.sample(logits, [0])[0]) for _ in range(6)]
    assert tokens == [0, 1, 2, 0, 1, 2]


# ----------------------------------------------------------------------------------- slots


def test_release_frees_the_slot() -> None:
    sampler = new_sampler(max_slots=2)
    sampler.start(1, params(temperature=0.0, presence_penalty=1.0, seed=5), [2])
    sampler.sample(forcing([7]), [1])
    sampler.release(1)
    with pytest.raises(ValueError, match="no request"):
        sampler.sample(torch.zeros(1, VOCAB), [1])
    sampler.start(1, params(temperature=0.0), [])  # reusable, and nothing of the old request
    assert torch.equal(sampler.penalized(torch.ones(1, VOCAB), [1]), torch.ones(1, VOCAB))


def test_bad_calls_are_refused() -> None:
    sampler = new_sampler(max_slots=2)
    with pytest.raises(IndexError):
        sampler.start(2, params(), [])
    with pytest.raises(IndexError):
        sampler.start(-1, params(), [])
    sampler.start(0, params(), [])
    with pytest.raises(ValueError, match="twice"):
        sampler.sample(torch.zeros(2, VOCAB), [0, 0])
    with pytest.raises(ValueError, match="do not match"):
        sampler.sample(torch.zeros(1, VOCAB + 1), [0])


def test_empty_batch() -> None:
    tokens, logprobs = new_sampler().sample(torch.zeros(0, VOCAB), [])
    assert tokens.shape == (0,) and logprobs == []


# ------------------------------------------------------------------------ batch invariance

TEMPERATURES = [0.0, 0.5, 1.0, 1.7]
request_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from(TEMPERATURES),
    top_k=st.sampled_from([-1, 0, 1, 3, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.1]),
    frequency_penalty=st.sampled_from([0.0, 0.7]),
    presence_penalty=st.sampled_from([0.0, -0.4]),
    repetition_penalty=st.sampled_from([1.0, 1.4]),
    seed=st.none() | st.integers(0, 2**70),
)


def run_requests(
    requests: list[SamplingParams], ids: list[int], slots: list[int], steps: int
) -> dict[int, list[int]]:
    """Run requests (known by ids) together in the given rows and slots; tokens per id."""
    sampler = new_sampler(max_slots=8)
    for request, slot in zip(ids, slots, strict=True):
        sampler.start(slot, requests[request], [request, request + 1])
    out: dict[int, list[int]] = {request: [] for request in ids}
    for step in range(steps):
        logits = torch.stack([request_logits(request, step) for request in ids])
        tokens, _ = sampler.sample(logits, slots)
        for request, token in zip(ids, tokens.tolist(), strict=True):
            out[request].append(token)
    return out


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(request_params, min_size=1, max_size=6),
    data=st.data(),
)
def test_seeded_and_greedy_rows_do_not_depend_on_the_batch(
    requests: list[SamplingParams], data: st.DataObject
) -> None:
    ids = data.draw(st.permutations(range(len(requests))), label="row order")
    slots = data.draw(st.permutations(range(8)), label="slots")[: len(ids)]
    together = run_requests(requests, ids, slots, steps=4)
    for request, p in enumerate(requests):
        if p.greedy or p.seed is not None:
            alone = run_requests(requests, [request], [7 - slots[0]], steps=4)
            assert together[request] == alone[request]


def test_same_seed_same_stream_in_any_slot_and_different_seeds_differ() -> None:
    p = params(temperature=1.0, seed=42)
    first = run_requests([p], [0], [0], steps=40)[0]
    assert run_requests([p], [0], [6], steps=40)[0] == first
    other = run_requests([params(temperature=1.0, seed=43)], [0], [0], steps=40)[0]
    assert sum(a == b for a, b in zip(first, other, strict=True)) < 20


def test_seeded_row_matches_draw_token() -> None:
    # Same probabilities, same filters, same noise: the batched sampler and the single-request
    # path agree draw for draw (temperatures whose reciprocal is exact).
    for temperature in (1.0, 0.5):
        sampler = new_sampler()
        sampler.start(
            2, params(temperature=temperature, top_k=10, top_p=0.8, min_p=0.02, seed=9), []
        )
        gen = torch.Generator().manual_seed(9)
        for step in range(30):
            logits = request_logits(0, step)
            assert int(sampler.sample(logits.unsqueeze(0), [2])[0]) == draw_token(
                logits, temperature, top_k=10, top_p=0.8, min_p=0.02, generator=gen
            )


# --------------------------------------------------------------------------------- filters


def test_filter_probs_batch_matches_filter_probs_row_by_row() -> None:
    # Exact binary fractions in shuffled order: no rounding, no ties.
    probs = torch.tensor([0.1875, 0.5, 0.0625, 0.25])
    cases = [
        (4, 1.0, 0.0),
        (2, 1.0, 0.0),
        (4, 0.75, 0.0),
        (4, 0.6, 0.0),
        (4, 1.0, 0.3),
        (3, 0.9, 0.2),
    ]
    batch = probs.repeat(len(cases), 1)
    top_k = torch.tensor([k for k, _, _ in cases])
    top_p = torch.tensor([p for _, p, _ in cases])
    min_p = torch.tensor([m for _, _, m in cases])
    got = filter_probs_batch(batch, top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(cases):
        want = filter_probs(probs, top_k=k, top_p=p, min_p=m)
        assert torch.equal(got[row], want), (k, p, m)


def allowed(probs: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens that top-k, min-p and top-p could keep, however ties are broken (a superset)."""
    vocab = probs.shape[0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    kth = torch.sort(probs, descending=True).values[k - 1]
    floor = torch.tensor(p.min_p, dtype=probs.dtype) * probs.max()
    kept = (probs >= kth) & (probs >= floor)
    mass = probs[kept].sum().item()
    ok = set()
    for token in kept.nonzero().flatten().tolist():
        # Mass strictly ahead of this token, whichever way ties sort; slack for summation order.
        ahead = probs[kept & (probs > probs[token])].sum().item()
        if p.top_p >= 1.0 or ahead < p.top_p * mass + 1e-6:
            ok.add(token)
    return ok


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(
        st.sampled_from([-4.0, -1.0, 0.0, 0.5, 1.0, 2.0, 2.0001]) | st.floats(-8.0, 8.0),
        min_size=2,
        max_size=24,
    ),
    temperature=st.floats(0.2, 2.0),
    top_k=st.integers(-1, 30),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_produce_an_excluded_token(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    vocab, rows = len(logits), 24
    p = params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = torch.tensor(logits)
    sampler = Sampler(rows, vocab, CPU, seed=0)
    for slot in range(rows):  # half seeded, half on the shared stream
        seed = slot if slot % 2 else None
        sampler.start(slot, msgspec.structs.replace(p, seed=seed), [])
    tokens, _ = sampler.sample(row.repeat(rows, 1), list(range(rows)))
    probs = torch.softmax(row.unsqueeze(0) / torch.tensor([[temperature]]), dim=-1)[0]
    assert set(tokens.tolist()) <= allowed(probs, p)


def test_a_zero_noise_draw_cannot_pick_a_filtered_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exp(1) draws of exactly 0 would give 0 / 0 = NaN for filtered tokens, and NaN wins argmax.
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())
    sampler = new_sampler()
    sampler.start(0, params(temperature=1.0, top_k=2), [])
    sampler.start(1, params(temperature=1.0, min_p=0.5, seed=3), [])
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1)
    tokens, _ = sampler.sample(logits, [0, 1])
    assert tokens.tolist()[0] in (VOCAB - 1, VOCAB - 2)
    assert tokens.tolist()[1] == VOCAB - 1


# ----------------------------------------------------------------------------- frequencies

CHI2_CRIT = {2: 18.4, 3: 21.1, 4: 23.5}  # p = 1e-4; fixed seeds make each run identical anyway


def test_seeded_frequencies_follow_the_filtered_distribution() -> None:
    target = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    p = dict(temperature=0.8, top_k=5, top_p=0.9)
    probs = torch.softmax(torch.log(target) / 0.8, dim=-1)
    want = filter_probs(probs, top_k=5, top_p=0.9)
    assert (want == 0).sum() >= 1  # the cut is real
    rows, steps = 400, 15
    sampler = Sampler(rows, 6, CPU, seed=0)
    for slot in range(rows):
        sampler.start(slot, params(**p, seed=10_000 + slot), [])
    logits = torch.log(target).repeat(rows, 1)
    counts = torch.zeros(6, dtype=torch.int64)
    for _ in range(steps):
        tokens, _ = sampler.sample(logits, list(range(rows)))
        counts += torch.bincount(tokens, minlength=6)
    kept = (want > 0).nonzero().flatten().tolist()
    assert counts[want == 0].sum() == 0
    renorm = (want[kept] / want.sum()).tolist()
    assert chi_square(counts[kept].tolist(), renorm) < CHI2_CRIT[len(kept) - 1]


def test_unseeded_rows_follow_softmax_with_a_fixed_sampler_seed() -> None:
    target = [0.4, 0.3, 0.2, 0.1]
    rows, steps = 500, 12
    sampler = Sampler(rows, 4, CPU, seed=7)
    for slot in range(rows):
        sampler.start(slot, params(temperature=1.0), [])
    counts = torch.zeros(4, dtype=torch.int64)
    for _ in range(steps):
        tokens, _ = sampler.sample(torch.log(torch.tensor(target)).repeat(rows, 1), range(rows))
        counts += torch.bincount(tokens, minlength=4)
    assert chi_square(counts.tolist(), target) < CHI2_CRIT[3]


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


# ------------------------------------------------------------------------------------ CUDA


@CUDA_ONLY
def test_cuda_matches_the_contract_without_syncs() -> None:
    device = torch.device("cuda")
    vocab = 4096
    batch = [
        params(temperature=0.0),
        params(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5),
        params(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=11),
        params(temperature=1.0, seed=12, frequency_penalty=0.3),
        params(temperature=1.0),
    ]

    def run(ids: list[int], slots: list[int], steps: int = 6) -> dict[int, list[int]]:
        sampler = Sampler(8, vocab, device, seed=0)
        for request, slot in zip(ids, slots, strict=True):
            sampler.start(slot, batch[request], [request, 7, 9])
        steps_logits = [
            torch.stack([request_logits(r, step, vocab) for r in ids]).to(device)
            for step in range(steps)
        ]
        seqs: list[torch.Tensor] = []
        torch.cuda.set_sync_debug_mode("error")  # only the sampler runs under it
        try:
            for logits in steps_logits:
                tokens, _ = sampler.sample(logits, slots)
                assert tokens.device.type == "cuda" and tokens.dtype == torch.int64
                seqs.append(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        per_row = torch.stack(seqs, dim=1).tolist()
        return dict(zip(ids, per_row, strict=True))

    together = run([4, 2, 0, 3, 1], [3, 0, 6, 1, 2])
    for request in range(4):  # every row but the unseeded sampled one
        assert run([request], [5])[request] == together[request]
    first_logits = request_logits(0, 0, vocab)
    assert together[0][0] == int(torch.argmax(first_logits))

    sampler = Sampler(2, vocab, device, seed=0)
    sampler.start(1, params(temperature=0.7, logprobs=True, top_logprobs=4), [])
    logits = request_logits(0, 0, vocab).unsqueeze(0).to(device)
    tokens, (entry,) = sampler.sample(logits, [1])
    assert entry is not None and entry.token_id == tokens.item()
    raw = torch.log_softmax(logits[0], dim=-1).cpu()
    assert entry.logprob == pytest.approx(raw[entry.token_id].item(), abs=1e-5)
    assert [t for t, _ in entry.top] == torch.topk(raw, 4).indices.tolist()


def test_resumed_request_continues_its_seeded_stream_and_penalty_counts() -> None:
    params = SamplingParams(temperature=1.0, seed=99, frequency_penalty=0.5, presence_penalty=0.3)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    straight = Sampler(2, 50, "cpu")
    straight.start(0, params, [1, 2, 3])
    tokens = [int(straight.sample(logits, [0])[0][0]) for _ in range(6)]
    resumed = Sampler(2, 50, "cpu")
    resumed.start(1, params, [1, 2, 3], output_ids=tokens[:4])
    assert [int(resumed.sample(logits, [1])[0][0]) for _ in range(2)] == tokens[4:]


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
