"""What the hopper backend's L2 prefetch asks for (host side; the kernel runs on the GPU only:
tests/gpu/test_prefetch_gpu.py)."""

from __future__ import annotations

import torch

from m3serve.backends.hopper import HopperBackend, prefetch_ranges
from m3serve.backends.reference import ReferenceBackend
from m3serve.model.weights import Mxfp8Weight


def mxfp8(rows: int, k: int) -> Mxfp8Weight:
    codes = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    return Mxfp8Weight(codes, torch.zeros(rows, k // 32, dtype=torch.uint8))


def test_an_mxfp8_weight_is_prefetched_in_whole_rows_of_codes_and_their_scales() -> None:
    w = mxfp8(100, 256)  # a row: 256 code bytes and 8 scale bytes
    ranges = prefetch_ranges(w, budget=10 * 264 + 263)
    assert [(t is w.codes, t is w.scales, n) for t, n in ranges] == [
        (True, False, 10 * 256),
        (False, True, 10 * 8),
    ]


def test_a_budget_past_the_weight_asks_for_all_of_it_and_a_spent_one_for_nothing() -> None:
    w = mxfp8(4, 64)
    assert [n for _, n in prefetch_ranges(w, budget=1 << 30)] == [4 * 64, 4 * 2]
    assert prefetch_ranges(w, budget=0) == []
    assert prefetch_ranges(w, budget=-5) == []
    assert prefetch_ranges(w, budget=64 + 1) == []  # not one whole row (64 + 2 bytes)


def test_a_dense_weight_is_prefetched_in_whole_rows() -> None:
    w = torch.zeros(8, 16, dtype=torch.bfloat16)  # 32 bytes a row
    [(tensor, nbytes)] = prefetch_ranges(w, budget=100)
    assert tensor is w and nbytes == 3 * 32


def test_without_a_gpu_the_prefetching_block_only_runs_its_body() -> None:
    w = mxfp8(4, 64)
    ran = []
    for backend in (HopperBackend(torch.device("cpu"), interpreter=True),
                    ReferenceBackend(torch.device("cpu"))):  # fmt: skip
        with backend.prefetching([w], tokens=1):
            ran.append(backend.name)
    assert ran == ["hopper", "reference"]
