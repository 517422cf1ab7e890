"""`SlotLengths`, the executor thread's committed length per slot: decode and verify rows start
there whatever the (lagging) plan said, prefill chunks keep their exact start and reset it, and a
plan ahead of what was committed is refused."""

from __future__ import annotations

import pytest

from m3serve.core.spec.lengths import SlotLengths
from m3serve.runtime.messages import SeqStep


def test_a_verify_row_starts_past_the_drafts_the_last_one_kept() -> None:
    lengths = SlotLengths(2)
    lengths.advance(SeqStep([1, 2, 3, 4, 5], 0, [0, 1], slot=1), 5)  # the prompt
    first = SeqStep(None, 5, [0, 1, 2], slot=1, draft=3)
    (ran,) = lengths.resolve([first])
    assert ran.start == 5
    lengths.advance(ran, 1 + 2)  # anchor and two accepted drafts
    # Planned before that verdict: one past the previous anchor, as the scheduler counts.
    (second,) = lengths.resolve([SeqStep(None, 6, [0, 1, 2, 3], slot=1, draft=3)])
    assert second.start == 8 and second.draft == 3


def test_a_prefill_chunk_keeps_its_start_and_resets_the_slot() -> None:
    lengths = SlotLengths(1)
    lengths.advance(SeqStep(None, 20, [0, 1, 2, 3, 4, 5, 6, 7]), 8)  # an old request's row
    chunk = SeqStep([7, 8, 9], 4, [3, 4])  # a new request after a prefix hit of 4 tokens
    assert lengths.resolve([chunk]) == [chunk]
    lengths.advance(chunk, 3)
    (decode,) = lengths.resolve([SeqStep(None, 7, [3, 4])])
    assert decode.start == 7


def test_a_plan_ahead_of_the_committed_tokens_is_refused() -> None:
    lengths = SlotLengths(1)
    lengths.advance(SeqStep([1, 2], 0, [0]), 2)
    with pytest.raises(RuntimeError, match="past the 2 tokens committed"):
        lengths.resolve([SeqStep(None, 3, [0])])


def test_placed_rows_run_at_their_planned_starts() -> None:
    """The warm-up's rows continue no request: placing them makes their starts the slots'."""
    lengths = SlotLengths(2)
    lengths.advance(SeqStep([1, 2], 0, [0]), 2)
    rows = [SeqStep(None, 40, list(range(12)), slot=0, draft=7), SeqStep(None, 9, [0, 1], slot=1)]
    lengths.place(rows)
    assert lengths.resolve(rows) == rows
