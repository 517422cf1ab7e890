"""SlotPool (m3serve.core.kvcache.slots): a slot belongs to one request at a time, and a bad
free is loud."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.kvcache.slots import SlotPool


def test_lowest_free_slot_first_and_none_when_full() -> None:
    slots = SlotPool(3)
    assert [slots.alloc(), slots.alloc(), slots.alloc()] == [0, 1, 2]
    assert slots.alloc() is None
    slots.free(1)
    assert slots.num_free == 1
    assert slots.alloc() == 1


@pytest.mark.parametrize(("slot", "message"), [(1, "double free"), (3, "out of range")])
def test_bad_free_raises(slot: int, message: str) -> None:
    slots = SlotPool(3)
    slots.alloc()
    with pytest.raises(ValueError, match=message):
        slots.free(slot)
    assert slots.num_free == 2
    slots.check()


@settings(max_examples=100, deadline=None)
@given(num_slots=st.integers(0, 8), ops=st.lists(st.integers(-1, 7), max_size=40))
def test_random_alloc_free_never_shares_a_slot(num_slots: int, ops: list[int]) -> None:
    """op -1 allocates; op k frees the k-th held slot, or double-frees a free one if k is past
    the end of the held list."""
    slots, held = SlotPool(num_slots), []
    for op in ops:
        if op < 0:
            slot = slots.alloc()
            assert (slot is None) == (len(held) == num_slots)
            if slot is not None:
                assert slot not in held
                held.append(slot)
        elif op < len(held):
            slots.free(held.pop(op))
        elif len(held) < num_slots:
            free = sorted(set(range(num_slots)) - set(held))
            with pytest.raises(ValueError, match="double free"):
                slots.free(free[op % len(free)])
        slots.check()
        assert slots.num_free == num_slots - len(held)
