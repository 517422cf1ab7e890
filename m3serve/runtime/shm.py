"""Shared-memory segments for bulk payloads (long prompts' token ids, later images and KV pages).

This module owns segment naming, the hand-over rule and cleanup. A segment is named
`m3s-<session>-<counter>` (a POSIX shm name, a file in /dev/shm on Linux); the counter is
`<pid>_<n>` so that processes sharing a session never pick the same name. Hand-over: the creator
writes the payload, closes the segment and forgets it; the receiver reads it once and unlinks it.
A segment whose receiver died stays behind until the supervisor removes every segment of its
session with `remove_session_segments` at shutdown. The session id starts with the pid of the
process that owns the run, so that segments left by an owner killed with SIGKILL can be told
apart from a live server's and removed at the next start (`runtime/orphans.py`).

Before Python 3.13 every `SharedMemory` open registers the segment with the process's
multiprocessing resource_tracker, which unlinks it with a "leaked" warning when the process
exits. Since the receiver, not the creator, unlinks, registrations are dropped here explicitly.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import itertools
import os
import re
import secrets
import sys
from collections.abc import Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import numpy.typing as npt

from m3serve.runtime.messages import ShmRef, TokenIds

PREFIX = "m3s"
SHM_DIR = Path("/dev/shm")
DEFAULT_SHM_THRESHOLD_BYTES = 64 * 1024

# Track the segment in resource_tracker at all? Only 3.13+ lets us say no when opening.
_CAN_SKIP_TRACKING = sys.version_info >= (3, 13)
_SESSION_RE = re.compile(r"[0-9A-Za-z]{1,16}")
_OWNED_SESSION_RE = re.compile(r"([0-9]{1,9})p[0-9a-f]{6}")
_counter = itertools.count()


def new_session_id() -> str:
    """A short id for one engine run, `<owner pid>p<random>`; every segment of the run carries
    it."""
    return f"{os.getpid()}p{secrets.token_hex(3)}"


def session_owner(session: str) -> int | None:
    """The pid of the process that made `session` (None for an id not made by new_session_id)."""
    match = _OWNED_SESSION_RE.fullmatch(session)
    return int(match.group(1)) if match else None


def segment_session(name: str) -> str | None:
    """The session id in a segment name `m3s-<session>-<counter>`, if it is one of ours."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] != PREFIX or not _SESSION_RE.fullmatch(parts[1]):
        return None
    return parts[1]


def _session_prefix(session: str) -> str:
    # Alphanumeric only, so that one session's prefix can never match another session's names.
    if not _SESSION_RE.fullmatch(session):
        raise ValueError(f"session id must be 1-16 letters or digits, got {session!r}")
    return f"{PREFIX}-{session}-"


def list_session_segments(session: str) -> list[str]:
    """Names of the session's segments that exist now (Linux: read from /dev/shm)."""
    prefix = _session_prefix(session)
    if not SHM_DIR.is_dir():
        return []
    return sorted(entry.name for entry in SHM_DIR.iterdir() if entry.name.startswith(prefix))


def remove_session_segments(session: str) -> int:
    """Unlink every segment left over from `session`; returns how many were removed."""
    removed = 0
    for name in list_session_segments(session):
        try:
            (SHM_DIR / name).unlink()
        except FileNotFoundError:
            continue  # its receiver unlinked it meanwhile
        removed += 1
    return removed


def _open(name: str, *, create: bool = False, size: int = 0) -> SharedMemory:
    if _CAN_SKIP_TRACKING:
        return SharedMemory(name, create=create, size=size, track=False)  # type: ignore[call-arg]
    return SharedMemory(name, create=create, size=size)


def _untrack(shm: SharedMemory) -> None:
    """Drop the resource_tracker registration that opening the segment made (before 3.13)."""
    if not _CAN_SKIP_TRACKING:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _create(session: str, size: int) -> SharedMemory:
    prefix = _session_prefix(session)
    while True:
        name = f"{prefix}{os.getpid()}_{next(_counter)}"
        try:
            return _open(name, create=True, size=size)
        except FileExistsError:
            continue  # left over by an earlier process with the same pid; take the next number


def create_segment(session: str, size: int) -> SharedMemory:
    """A long-lived segment of the session (the host KV pool), left open for its creator.

    Unlike `write_array`'s hand-over segments, the creator keeps it and unlinks it when done;
    if the creator dies first, the supervisor's `remove_session_segments` (or the next start's
    orphan sweep) removes it, since its name carries the session.
    """
    shm = _create(session, max(size, 1))
    _untrack(shm)
    return shm


def attach_segment(name: str) -> SharedMemory:
    """Open a segment another process created (`create_segment`); close it, never unlink it."""
    shm = _open(name)
    _untrack(shm)
    return shm


def unlink_segment(shm: SharedMemory) -> None:
    """Close and remove a segment from `create_segment`. Not `shm.unlink()`: before 3.13 that
    also unregisters it from a resource_tracker that no longer knows it, which warns."""
    name = shm.name
    shm.close()
    if _CAN_SKIP_TRACKING:
        shm.unlink()
        return
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def write_array(arr: np.ndarray, session: str) -> ShmRef:
    """Copy `arr`'s bytes (C order) into a new segment and hand back its handle.

    The segment is closed and no longer tracked by this process: whoever receives the handle
    reads it with `read_array`, which unlinks it. Dtype and shape are the receiver's to know.
    """
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    # POSIX refuses zero-sized segments; an empty payload still needs a name to hand over.
    shm = _create(session, max(flat.nbytes, 1))
    try:
        np.frombuffer(shm.buf, np.uint8, count=flat.nbytes)[:] = flat
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    _untrack(shm)
    return ShmRef(name=shm.name, nbytes=flat.nbytes)


def read_array(ref: ShmRef, dtype: npt.DTypeLike, unlink: bool = True) -> np.ndarray:
    """Copy the segment out as a 1-D array of `dtype`, close it and (by default) unlink it."""
    dtype = np.dtype(dtype)
    if ref.nbytes % dtype.itemsize:
        raise ValueError(f"segment {ref.name}: {ref.nbytes} bytes is not a whole number of {dtype}")
    shm = _open(ref.name)
    try:
        if shm.size < ref.nbytes:
            raise ValueError(f"segment {ref.name} holds {shm.size} bytes, handle says {ref.nbytes}")
        out = np.empty(ref.nbytes // dtype.itemsize, dtype)
        out.view(np.uint8)[:] = np.frombuffer(shm.buf, np.uint8, count=ref.nbytes)
    finally:
        shm.close()
        # unlink() also drops the registration made by opening; without it, drop it by hand.
        if unlink:
            shm.unlink()
        else:
            _untrack(shm)
    return out


def _as_int32(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return arr
    if arr.size == 0:
        return np.empty(0, np.int32)  # np.asarray([]) is float64
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype}")
    out = arr.astype(np.int32)
    if not np.array_equal(out, arr):
        raise ValueError("token ids must fit in int32")
    return out


def pack_token_ids(
    ids: Sequence[int] | np.ndarray,
    session: str,
    shm_threshold_bytes: int = DEFAULT_SHM_THRESHOLD_BYTES,
) -> TokenIds:
    """Token ids as int32: inline below `shm_threshold_bytes`, in a shm segment at or above."""
    arr = _as_int32(ids)
    if arr.nbytes >= shm_threshold_bytes:
        return TokenIds(count=arr.size, shm=write_array(arr, session))
    return TokenIds(count=arr.size, array=arr)


def unpack_token_ids(t: TokenIds) -> np.ndarray:
    """The int32 ids of `t` (a shm segment is read once and unlinked); checks `t.count`."""
    if t.shm is not None:
        arr = read_array(t.shm, np.int32)
    elif t.array is not None:
        arr = t.array
    elif t.count == 0:
        arr = np.empty(0, np.int32)
    else:
        raise ValueError(f"TokenIds of {t.count} ids carries neither an array nor a segment")
    if arr.dtype != np.int32 or arr.ndim != 1:
        raise ValueError(f"TokenIds must hold a 1-D int32 array, got {arr.dtype} {arr.shape}")
    if arr.size != t.count:
        raise ValueError(f"TokenIds says {t.count} ids but {arr.size} arrived")
    return arr
