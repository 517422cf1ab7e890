"""The L3 storage tier's interface: page blobs by key, and the backends this build has.

A backend stores whole host pages (opaque bytes) under their page key (`core/hicache/keys.py`).
Its methods are blocking and are called from the host-cache actor's I/O threads, several at a
time, so a backend must be safe to call concurrently, and also safe to share with other
processes (replicas on the same store).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

from m3serve.runtime.config import STORAGE_BACKENDS, HiCacheArgs
from m3serve.runtime.paths import cache_root

_KEY_RE = re.compile(r"[0-9a-f]{16,128}")


class StorageBackend(ABC):
    """exists / put / get of page blobs by key."""

    name: str

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a whole page is stored under `key`."""

    @abstractmethod
    def put(self, key: str, page: memoryview) -> bool:
        """Store `page` under `key`; False when it was already there (it is left as it was).
        A reader never sees a part of a page: it sees the whole page or none."""

    @abstractmethod
    def get(self, key: str, out: memoryview) -> bool:
        """Fill `out` with the page stored under `key`; False (and `out` unspecified) when there
        is none of exactly `len(out)` bytes."""


def is_key(key: str) -> bool:
    """Keys are hex digests (core/hicache/keys.py); anything else, a path say, names no file."""
    return _KEY_RE.fullmatch(key) is not None


def check_key(key: str) -> str:
    if not is_key(key):
        raise ValueError(f"not a page key: {key!r}")
    return key


def default_storage_dir() -> Path:
    return cache_root() / "hicache"


def open_storage(args: HiCacheArgs) -> StorageBackend | None:
    """The backend `--hicache-storage-backend` names, or None without L3 storage."""
    from m3serve.actors.hicache.file_storage import FileStorage

    backends: dict[str, type[FileStorage]] = {"file": FileStorage}
    assert set(backends) == set(STORAGE_BACKENDS), "config.STORAGE_BACKENDS is out of date"
    name = args.hicache_storage_backend
    if name is None:
        return None
    directory = Path(args.hicache_storage_dir) if args.hicache_storage_dir else None
    return backends[name](directory or default_storage_dir())
