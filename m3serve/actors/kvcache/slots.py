"""Request slots: a running request owns one row of the executor's per-request device tables
(page table, token table), and that row's index is its slot."""

from __future__ import annotations

import heapq


class SlotPool:
    """Slots 0..num_slots-1; `alloc` hands out the lowest free one so runs are reproducible."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._num_slots = num_slots
        self._free = list(range(num_slots))  # a min-heap; a sorted list is already one
        self._is_free = [True] * num_slots

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """The lowest free slot, or None when every slot is taken."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; an unknown or already free slot is a caller bug and raises."""
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self._num_slots - 1}")
        if self._is_free[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._is_free[slot] = True
        heapq.heappush(self._free, slot)

    def check(self) -> None:
        """Raise AssertionError unless the free and taken slots partition 0..num_slots-1."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is in the free list twice"
        flagged = {slot for slot, is_free in enumerate(self._is_free) if is_free}
        assert flagged == free, "free flags disagree with the free list"
