"""Request slots: a running request owns one row of the engine core's per-request device tables
(the token each slot sampled last), and that row's index is its slot."""

from __future__ import annotations

from m3serve.core.kvcache.pages import PagePool


class SlotPool:
    """Slots 0..num_slots-1: the same lowest-first free list as pages, one id at a time."""

    def __init__(self, num_slots: int) -> None:
        self._ids = PagePool(num_slots)

    @property
    def num_slots(self) -> int:
        return self._ids.num_pages

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    def alloc(self) -> int | None:
        """The lowest free slot, or None when every slot is taken."""
        ids = self._ids.alloc(1)
        return ids[0] if ids else None

    def free(self, slot: int) -> None:
        """Give a slot back; an unknown or already free slot is a caller bug and raises."""
        self._ids.free([slot])

    def check(self) -> None:
        self._ids.check()
