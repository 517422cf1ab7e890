"""The local-file L3 backend: one file per page, named by its key, under a directory that any
number of processes (replicas) may share.

`<dir>/<key[:2]>/<key>` holds exactly one page's bytes; the two-digit subdirectories keep any one
directory small. A page is written to a temporary name in the same subdirectory and renamed into
place, so a reader, a crash or a replica writing the same page at the same time never exposes a
partial file; temporary names start with "." and are never read as pages. A short file (e.g. left
by a power loss before the data reached the disk) fails the size check and counts as absent.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import time
from pathlib import Path

from m3serve.actors.hicache.storage import StorageBackend, check_key

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
# A temporary file older than this was left by a writer that died; younger ones may be in use.
STALE_TMP_S = 3600.0


class FileStorage(StorageBackend):
    name = "file"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        removed = remove_stale_tmp(self.root)
        if removed:
            log.info("removed %d temporary page files left in %s", removed, self.root)

    def path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, page: memoryview) -> bool:
        final = self.path(key)
        if final.is_file():
            return False  # pages under one key are equal; keep the first, spare the disk
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f".{key}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        try:
            with open(tmp, "xb") as f:
                f.write(page)
            os.replace(tmp, final)  # atomic: readers see the old state or the whole page
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def get(self, key: str, out: memoryview) -> bool:
        try:
            f = open(self.path(key), "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return False
        with f:
            if os.fstat(f.fileno()).st_size != out.nbytes:
                return False
            return _read_fully(f, out)


def _read_fully(f: io.RawIOBase, out: memoryview) -> bool:
    done = 0
    while done < out.nbytes:
        n = f.readinto(out[done:])
        if not n:
            return False  # the file shrank under us
        done += n
    return True


def remove_stale_tmp(root: Path, max_age_s: float = STALE_TMP_S) -> int:
    """Remove temporary page files older than `max_age_s` (their writer died); returns how many."""
    cutoff = time.time() - max_age_s
    removed = 0
    for tmp in root.glob(f"*/.*{TMP_SUFFIX}"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            continue  # its writer finished or another replica removed it
    return removed
