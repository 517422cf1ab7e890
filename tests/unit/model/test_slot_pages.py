"""Slot page lists on the device (`SlotPages`): rows that carry only what changed since their
slot's last step build the same batch as rows that carry whole lists — whatever mix of growth,
pages given back and slots taken over by new requests came before."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m3serve.model.batch as batch_module
from m3serve.model.batch import ForwardBatch
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import SeqStep

PAGE, SLOTS, POOL = 4, 3, 40

# One step of one slot: grow by n pages, give back n pages (a verify step's tail), or a new
# request taking the slot over with a list of n pages.
Op = tuple[str, int]
ops = st.tuples(st.sampled_from(["grow", "shrink", "new"]), st.integers(0, 3))
steps = st.lists(st.lists(st.tuples(st.integers(0, SLOTS - 1), ops), min_size=1, max_size=3))


@settings(max_examples=150, deadline=None)
@given(history=steps)
def test_page_deltas_build_the_batch_whole_lists_build(history: list[list[tuple[int, Op]]]) -> None:
    slot_pages = SlotPages(SLOTS, POOL, "cpu")
    lists: dict[int, list[int]] = {s: [] for s in range(SLOTS)}
    synced = dict.fromkeys(range(SLOTS), 0)  # what the scheduler knows the slot holds
    next_page = 0
    for step in history:
        whole, deltas = [], []
        for slot in dict.fromkeys(s for s, _ in step):  # one row per slot in a step
            kind, n = next(op for s, op in step if s == slot)
            pages = lists[slot]
            if kind == "new":
                pages[:] = [(next_page + i) % POOL for i in range(n + 1)]
                synced[slot] = 0
            elif kind == "grow":
                pages.extend((next_page + i) % POOL for i in range(n))
            else:
                keep = max(1, len(pages) - n)
                del pages[keep:]
                synced[slot] = min(synced[slot], keep)
            next_page += n + 1
            if not pages:
                pages.append(next_page % POOL)
            start = max(0, len(pages) * PAGE - 2)  # the last tokens of the list's last page
            whole.append(SeqStep([5], start, list(pages), slot=slot))
            deltas.append(
                SeqStep([5], start, pages[synced[slot] :], slot=slot, page_start=synced[slot])
            )
            synced[slot] = len(pages)
        want = ForwardBatch.build(whole, PAGE, "cpu")
        got = ForwardBatch.build(deltas, PAGE, "cpu", slot_pages=slot_pages)
        assert torch.equal(got.page_table, want.page_table)
        assert torch.equal(got.out_slots, want.out_slots)


def test_a_decode_inside_its_last_page_sends_no_pages_and_copies_nothing() -> None:
    slot_pages = SlotPages(2, 8, "cpu")
    ForwardBatch.build([SeqStep([1, 2, 3], 0, [6], slot=1)], PAGE, "cpu", slot_pages=slot_pages)
    before = slot_pages.table.clone()
    slot_pages.table.fill_(99)  # an update would write over this
    batch = ForwardBatch.build(
        [SeqStep([4], 3, [], slot=1, page_start=1)], PAGE, "cpu", slot_pages=slot_pages
    )
    assert torch.equal(slot_pages.table, torch.full_like(before, 99))
    assert batch.out_slots.tolist() == [6 * PAGE + 3]


def test_a_change_past_what_the_slot_holds_is_refused() -> None:
    slot_pages = SlotPages(1, 8, "cpu")
    seq = SeqStep([1], 0, [3], slot=0, page_start=2)
    with pytest.raises(ValueError, match="holds 0"):
        ForwardBatch.build([seq], PAGE, "cpu", slot_pages=slot_pages)
    with pytest.raises(ValueError, match="whole page list"):
        ForwardBatch.build([seq], PAGE, "cpu")
    too_long = msgspec.structs.replace(seq, page_start=0, pages=list(range(9)))
    with pytest.raises(ValueError, match="the table holds 8"):
        ForwardBatch.build([too_long], PAGE, "cpu", slot_pages=slot_pages)


def test_rows_without_input_ids_take_their_slots_last_token_in_the_steps_one_upload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode row and a verify row (its first token the slot's last, its drafts written
    later) beside a prompt chunk; the slots' page changes and those rows' slots go up with the
    batch's arrays in one copy."""
    uploads: list[int] = []
    upload_many = batch_module.upload_many

    def counted(items, device):  # type: ignore[no-untyped-def]
        uploads.append(len(items))
        return upload_many(items, device)

    monkeypatch.setattr(batch_module, "upload_many", counted)
    slot_pages = SlotPages(3, 8, "cpu")
    last = torch.tensor([70, 71, 72])  # each slot's last token, on the "device"
    seqs = [
        SeqStep(None, 5, [1, 2], slot=2),  # a decode row: 1 token
        SeqStep([9, 8, 7], 0, [3], slot=0),  # a prompt chunk
        SeqStep(None, 4, [4, 5], slot=1, draft=2),  # a verify row: 3 tokens
    ]
    batch = ForwardBatch.build(seqs, PAGE, "cpu", slot_pages=slot_pages, slot_tokens=last)
    assert batch.input_ids.tolist() == [72, 9, 8, 7, 71, 0, 0]
    assert uploads == [11]  # 7 arrays of the batch, 2 for the rows' tokens, 2 page changes
    assert slot_pages.table[1, :2].tolist() == [4, 5] and slot_pages.table[2, :2].tolist() == [1, 2]
