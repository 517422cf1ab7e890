"""Physical KV pages: which page ids of the device pool are free.

A page holds `page_size` tokens of KV in every layer's pool; this class only hands out ids. Freed
ids come back lowest first, so a given workload always lands on the same pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PagePool:
    """Page ids 0..num_pages-1, each either free or allocated."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._free = list(range(num_pages))  # a min-heap; a sorted list is already one
        self._is_free = [True] * num_pages

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, lowest ids first; None (allocating nothing) if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. A page that is out of range or already free is a bug in the
        caller, so it raises, and then nothing of this call is freed."""
        pages = list(pages)
        self._check_freeable(pages)
        for page in pages:
            self._is_free[page] = True
            heapq.heappush(self._free, page)

    def check(self) -> None:
        """Raise AssertionError unless the free and allocated ids partition 0..num_pages-1."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert all(0 <= page < self._num_pages for page in free), "a free page is out of range"
        flagged = {page for page, is_free in enumerate(self._is_free) if is_free}
        assert flagged == free, "free flags disagree with the free list"

    def _check_freeable(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for page in pages:
            if not 0 <= page < self._num_pages:
                raise ValueError(f"page {page} is out of range 0..{self._num_pages - 1}")
            if self._is_free[page] or page in seen:
                raise ValueError(f"double free of page {page}")
            seen.add(page)
