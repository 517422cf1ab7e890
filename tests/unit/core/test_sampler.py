"""The engine's batched sampler (m3serve.core.sampler.Sampler): greedy rows,
penalties, slots, the CUDA contract and resumed requests.

Penalties are checked against a per-row reference written in plain Python. Batch invariance,
filters and frequencies: test_sampler_draws.py; logprobs and grammar masks:
test_sampler_outputs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from m3serve.core.sampler import Sampler
from m3serve.runtime.messages import SamplingParams

from .sampler_cases import (
    CPU,
    CUDA_ONLY,
    VOCAB,
    forcing,
    host_reads_forbidden,
    new_sampler,
    params,
    request_logits,
)

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


def test_a_penalized_slot_counts_only_its_own_tokens_beside_unpenalized_rows() -> None:
    """Only penalized requests keep counts; the rows sampled beside them (and a penalized
    request that follows an unpenalized one in a slot) see exactly their own history."""
    sampler = new_sampler()
    penalty = params(temperature=0.0, frequency_penalty=1.0)
    sampler.start(0, params(temperature=0.0), [7])
    sampler.start(1, penalty, [])
    sampler.start(2, params(temperature=0.0), [8])
    for tokens in ([4, 5, 6], [4, 5, 6], [9, 9, 9]):
        sampler.sample(forcing(tokens), [0, 1, 2])
    got = sampler.penalized(torch.ones(1, VOCAB), [1])[0]
    assert got[5] == 1.0 - 2.0 and got[9] == 1.0 - 1.0
    assert (got[[t for t in range(VOCAB) if t not in (5, 9)]] == 1.0).all()
    sampler.start(0, penalty, [])  # slot 0 ran an unpenalized request before
    sampler.sample(forcing([3]), [0])
    got = sampler.penalized(torch.ones(1, VOCAB), [0])[0]
    assert got[3] == 0.0
    assert (got[[t for t in range(VOCAB) if t != 3]] == 1.0).all()


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


# ------------------------------------------------------------------------------------ CUDA


def probed_sampler() -> tuple[Sampler, list[tuple[torch.Tensor, ...]]]:
    """A CPU sampler whose device draw is a probe: the knobs of each call, and tokens 0."""
    sampler = new_sampler()
    calls: list[tuple[torch.Tensor, ...]] = []

    def probe(logits: torch.Tensor, *knobs: torch.Tensor) -> torch.Tensor:
        calls.append(knobs)
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    sampler._device_draw = probe
    return sampler, calls


def test_the_device_draw_gets_each_knob_in_its_own_dtype_and_offsets_that_advance() -> None:
    """The kernel's contract (kernels/triton/sampling.py `sample`): temperature, top_p, min_p
    float32, top_k int32 (0: off), seeds and offsets int64, each [B] contiguous; a row's offset
    is its draw count. Recorded here from a CPU sampler with the kernel swapped for a probe."""
    sampler, calls = probed_sampler()
    sampler.start(0, params(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, seed=5), [1])
    sampler.start(3, params(temperature=1.2, top_k=40, seed=6), [1])
    for _ in range(2):
        sampler.sample(torch.zeros(2, VOCAB), [3, 0])
    temperature, top_k, top_p, min_p, seeds, offsets = calls[-1]
    dtypes = [t.dtype for t in calls[-1]]
    assert dtypes == [torch.float32, torch.int32, torch.float32, torch.float32] + [torch.int64] * 2
    assert all(t.is_contiguous() and t.shape == (2,) for t in calls[-1])
    assert temperature.tolist() == pytest.approx([1.2, 0.7])
    assert top_k.tolist() == [40, 0] and top_p.tolist() == pytest.approx([1.0, 0.9])
    assert min_p.tolist() == pytest.approx([0.0, 0.05])
    assert calls[0][4].tolist() == seeds.tolist()  # a request's stream: the same seed
    assert calls[0][5].tolist() == [0, 0] and offsets.tolist() == [1, 1]


def test_graph_knobs_are_the_device_draws_then_greedy_padding() -> None:
    """A CUDA graph that draws its rows (core/graphs.py) gets the knobs `sample` would give
    the device draw, the graph's batch long (padding: greedy), and the same draw counts: a
    draw in a graph and one outside it continue one stream."""
    sampler, calls = probed_sampler()
    sampler.start(0, params(temperature=0.7, top_p=0.9, seed=5), [1])
    sampler.start(2, params(temperature=0.0), [1])
    sampler.start(3, params(temperature=1.2, top_k=40, seed=6), [1])
    knobs = sampler.graph_knobs([3, 2, 0], 4)
    assert knobs is not None
    temperature, top_k, top_p, min_p, seeds, offsets = knobs
    assert temperature == pytest.approx([1.2, 0.0, 0.7, 0.0])
    assert top_k == [40, 0, 0, 0] and top_p == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert min_p == pytest.approx([0.0] * 4) and offsets == [0, 0, 0, 0]
    assert seeds[3] == 0
    sampler.sample(torch.zeros(2, VOCAB), [3, 0])  # the next draw, outside a graph
    assert calls[-1][4].tolist() == [seeds[0], seeds[2]]
    assert calls[-1][5].tolist() == [1, 1]  # each row drew once in the graph
    again = sampler.graph_knobs([3, 2, 0], 4)
    assert again is not None and again[5] == [2, 0, 2, 0]  # the greedy row counts no draws


def test_graph_knobs_leave_penalties_and_logprobs_to_sample() -> None:
    sampler = new_sampler()
    assert sampler.graph_knobs([0], 1) is None  # a CPU sampler has no device draw
    sampler._device_draw = lambda logits, *knobs: torch.zeros(logits.shape[0], dtype=torch.int64)
    sampler.start(0, params(temperature=1.0), [1])
    sampler.start(1, params(temperature=1.0, presence_penalty=0.5), [1])
    sampler.start(2, params(temperature=1.0, logprobs=True), [1])
    assert sampler.graph_knobs([0, 1], 2) is None and sampler.graph_knobs([2, 0], 2) is None
    assert sampler.graph_knobs([0, 2], 1) is None  # more rows than the graph has
    knobs = sampler.graph_knobs([0], 2)
    assert knobs is not None and knobs[5] == [0, 0]  # no draw counted by the refusals
    with pytest.raises(ValueError, match="twice"):
        sampler.graph_knobs([0, 0], 2)


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
