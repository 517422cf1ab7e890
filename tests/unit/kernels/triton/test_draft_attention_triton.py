"""The Triton draft block attention (m3serve.kernels.triton.draft_attention) against the torch
reference, under TRITON_INTERPRET=1 on the CPU at tiny shapes (D 16, page 4, window 10): window
cut-offs, page boundaries, an empty context, requests of different lengths, a GQA group that
pads, bf16 and a strided q."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.devices import DEVICE
from helpers.draft_batch import DraftBatch, make_draft_batch

from m3serve.kernels.draft_attention import draft_attention as reference
from m3serve.kernels.triton.draft_attention import draft_attention, draft_num_splits

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check(batch: DraftBatch, dtype: torch.dtype = torch.float32) -> None:
    want = reference(*batch.to("cpu", dtype).to("cpu", torch.float32).args())
    got = draft_attention(*batch.to(DEVICE, dtype).args())
    assert got.dtype == dtype and not got.isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "anchors",
    [
        [0, 3],  # no context; a context ending mid-page
        [4, 8, 5],  # contexts ending at and just past a page boundary
        [9, 10, 23],  # shorter than, exactly and longer than the window
    ],
)
def test_matches_the_reference(anchors: list[int]) -> None:
    check(make_draft_batch(anchors, seed=sum(anchors)))


def test_window_starting_mid_page_and_a_block_of_three() -> None:
    # window 7 from anchor 18: the context starts at 12 (a page start) for slot 0 and moves
    # into the page for later slots; a 3-slot block pads to the tile.
    check(make_draft_batch([18, 13], block=3, window=7, seed=2))


def test_gqa_group_of_three_pads() -> None:
    check(make_draft_batch([6, 15], num_kv=1, group=3, seed=3))


def test_bf16() -> None:
    check(make_draft_batch([11, 2, 19], seed=4), torch.bfloat16)


def test_strided_q() -> None:
    batch = make_draft_batch([7, 12], seed=5)
    wide = torch.cat((batch.q, batch.q), dim=-1)[..., : batch.q.shape[-1]]
    assert not wide.is_contiguous()
    strided = DraftBatch(wide, *batch.args()[1:])
    torch.testing.assert_close(
        draft_attention(*strided.to(DEVICE).args()).cpu(),
        reference(*batch.args()),
        rtol=1e-4,
        atol=1e-4,
    )


def test_pages_wider_than_a_key_chunk() -> None:
    # Page 128 walks each page in two 64-key chunks; the 200-key window starts mid-chunk.
    check(make_draft_batch([0, 130, 255, 260], page_size=128, window=200, seed=6))


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_context_splits_merge_to_the_same_result(splits: int) -> None:
    # 3 does not divide the chunks; 8 leaves some splits empty (the empty context too).
    batch = make_draft_batch([0, 9, 23, 14], seed=7 + splits)
    want = reference(*batch.args())
    got = draft_attention(*batch.to(DEVICE).args(), num_splits=splits)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_split_count_is_a_power_of_two_bounded_by_the_work() -> None:
    cpu = torch.device("cpu")
    assert draft_num_splits(1, 4, 64, cpu) == 1  # the interpreter: one program per head
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        few, many = draft_num_splits(1, 4, 128, gpu), draft_num_splits(64, 4, 128, gpu)
        assert few >= many >= 1 and few & (few - 1) == 0
        assert draft_num_splits(1, 4, 3, gpu) <= 3
