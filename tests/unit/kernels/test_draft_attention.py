"""The batched torch reference of the draft's block attention equals a per-request oracle (the
dense reference op over each request's gathered window), with shuffled pages and a pool that is
NaN wherever no context is: window cut-offs, page boundaries, an empty context, mixed lengths."""

from __future__ import annotations

import pytest
import torch
from helpers.draft_batch import make_draft_batch, naive_draft_attention

from m3serve.kernels.draft_attention import context_slots, draft_attention


@pytest.mark.parametrize(
    "anchors",
    [
        [0],  # no context at all: only the block's own keys
        [3, 4, 5],  # the context ends mid-page, at a page boundary, just past one
        [9, 10, 23],  # shorter than, exactly and longer than the window (10)
        [1, 17, 2, 31],
    ],
)
def test_batched_reference_equals_the_per_request_oracle(anchors: list[int]) -> None:
    batch = make_draft_batch(anchors, seed=len(anchors))
    got = draft_attention(*batch.args())
    assert not got.isnan().any()
    torch.testing.assert_close(got, naive_draft_attention(batch), rtol=1e-5, atol=1e-5)


def test_window_of_one_sees_only_the_block() -> None:
    batch = make_draft_batch([6, 13], window=1, seed=5)
    torch.testing.assert_close(draft_attention(*batch.args()), naive_draft_attention(batch))


def test_a_narrow_page_table_bounds_the_gathered_context() -> None:
    # 3 pages of 4: the window (100) is wider than anything the table can name.
    batch = make_draft_batch([5, 9], window=100, seed=6)
    assert batch.page_table.shape[1] * batch.page_size < batch.window
    torch.testing.assert_close(draft_attention(*batch.args()), naive_draft_attention(batch))


def test_context_slots_mark_negative_positions_and_unmapped_pages_invalid() -> None:
    table = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32)
    positions, slots, valid = context_slots(table, torch.tensor([2, 6]), page_size=4, width=3)
    assert positions.tolist() == [[-1, 0, 1], [3, 4, 5]]
    assert valid.tolist() == [[False, True, True], [True, True, True]]
    assert slots.tolist() == [[0, 8, 9], [3, 4, 5]]
    _, _, valid = context_slots(table, torch.tensor([6, 6]), page_size=4, width=3)
    assert valid[0].tolist() == [True, False, False]  # page 1 of row 0 is unmapped
