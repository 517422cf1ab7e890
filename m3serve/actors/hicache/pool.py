"""HostPool: the host KV pool's shared-memory segment, as the host-cache actor sees it.

The actor creates the segment (named after the session, so the supervisor's cleanup removes it
if the actor dies), hands its name to the engine, which attaches it and copies KV pages in and
out, and unlinks it at shutdown. Page-major: page h is bytes [h * page_bytes, (h + 1) *
page_bytes). The actor never interprets a page; it moves whole pages to and from L3 storage.

With tensor parallelism the segment holds one such pool per rank, one after another, each
rank's KV slice of every page; host page h is then the `ranks` pieces at h, which the actor
stores under one key per rank (`rank_key`) and reads back only when every rank's is there.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

from m3serve.runtime.shm import SHM_DIR, create_segment, unlink_segment

log = logging.getLogger(__name__)


class HostPool:
    def __init__(self, session: str, page_bytes: int, num_pages: int, ranks: int = 1) -> None:
        if page_bytes < 1 or num_pages < 1 or ranks < 1:
            raise ValueError(
                f"a host pool needs pages: {num_pages} x {page_bytes} bytes x {ranks} ranks"
            )
        size = page_bytes * num_pages * ranks
        free = shm_free_bytes()
        if size > free:
            # tmpfs would take the segment and raise SIGBUS at the first page past its space.
            raise ValueError(
                f"a host pool of {size / 2**30:.2f} GiB does not fit in {SHM_DIR} "
                f"({free / 2**30:.2f} GiB free)"
            )
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.ranks = ranks
        self._shm = create_segment(session, size)
        self.name = self._shm.name

    def page(self, h: int, rank: int = 0) -> memoryview:
        """A view of `rank`'s piece of host page `h`; release it (`with pool.page(h) as view:`)
        when done, since the segment cannot be closed while views of it are out."""
        start = (rank * self.num_pages + h) * self.page_bytes
        return self._shm.buf[start : start + self.page_bytes]

    def rank_keys(self, key: str) -> list[str]:
        """The L3 key of each rank's piece of the page stored under `key`."""
        return [rank_key(key, rank, self.ranks) for rank in range(self.ranks)]

    def problem(self, keys: Sequence[str], pages: Sequence[int]) -> str | None:
        """Why a Backup or Prefetch over these pages cannot run, or None."""
        if len(keys) != len(pages):
            return f"{len(keys)} keys for {len(pages)} host pages"
        bad = [h for h in pages if not 0 <= h < self.num_pages]
        if bad:
            return f"host pages out of range 0..{self.num_pages - 1}: {bad[:8]}"
        if len(set(pages)) != len(pages):
            return "a host page is listed twice"
        return None

    def close(self) -> None:
        """Unlink the segment (the engine's mapping stays valid until it closes its own)."""
        try:
            unlink_segment(self._shm)
        except BufferError:
            # An I/O thread that did not finish still holds a view; the name is removed by the
            # supervisor's session cleanup.
            log.warning("host pool %s still in use at shutdown; left to the cleanup", self.name)


def shm_free_bytes() -> int:
    """Space left for shared memory (the tmpfs behind /dev/shm)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def rank_key(key: str, rank: int, ranks: int) -> str:
    """The L3 key of `rank`'s piece of a page keyed `key` in a pool of `ranks` ranks: the key
    itself with one rank (files of a single-rank server are found as they were), else a digest
    of the key, the rank and the rank count, as long as the key (a piece of a tp 2 page is
    never taken for one of a tp 4 page, whose slices hold other heads)."""
    if ranks == 1:
        return key
    digest = hashlib.sha256(f"{key}/rank {rank} of {ranks}".encode()).hexdigest()
    return digest[: len(key)] if len(key) <= len(digest) else digest
