"""What the sampler tests share: tiny logits and samplers, and a guard against host reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from m3serve.core.sampler import Sampler
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
