"""What a server killed with SIGKILL leaves behind, removed at the next start.

A clean shutdown removes the run directory (socket files, metric files) and every
shared-memory segment of its session (`Supervisor.cleanup`). A SIGKILL of the owning process
runs no cleanup, so both are named after the owner: `m3s-<session>-...` with the session id
starting with the owner's pid. At start, every such directory and segment whose owner is no
longer alive is removed; a live owner's are never touched, whoever it is.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from m3serve.runtime.shm import PREFIX, SHM_DIR, segment_session, session_owner

log = logging.getLogger(__name__)


def run_dir_root() -> Path:
    """Where run directories are made (the system temp directory)."""
    return Path(tempfile.gettempdir())


def new_run_dir(session: str, root: Path | None = None) -> Path:
    """A fresh run directory `m3s-<session>-<random>`, named so that `remove_orphans` can tell
    whose it is."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{session}-", dir=root or run_dir_root()))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True


def remove_orphans(run_root: Path | None = None, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the run directories and shared-memory segments of sessions whose owner process
    is dead; returns what was removed."""
    removed = []
    for directory in (run_root or run_dir_root(), shm_dir):
        if not directory.is_dir():
            continue
        for entry in directory.glob(f"{PREFIX}-*"):
            if _orphaned(entry.name) and _remove(entry):
                removed.append(entry)
    if removed:
        log.info("removed %d run directories and segments left by killed servers", len(removed))
    return removed


def _orphaned(name: str) -> bool:
    session = segment_session(name)
    owner = session_owner(session) if session else None
    return owner is not None and owner != os.getpid() and not pid_alive(owner)


def _remove(entry: Path) -> bool:
    try:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    except FileNotFoundError:
        return False  # another starting server removed it first
    except OSError as exc:
        log.warning("cannot remove %s left by a killed server: %s", entry, exc)
        return False
    return True
