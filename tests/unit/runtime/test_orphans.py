"""Run directories and segments left by a SIGKILLed server: removed at the next start when
their owner is dead, never when it is alive or when the name is not one of ours."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from m3serve.runtime.orphans import new_run_dir, pid_alive, remove_orphans
from m3serve.runtime.shm import new_session_id, session_owner


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_session_id_names_its_owner() -> None:
    session = new_session_id()
    assert session_owner(session) == os.getpid()
    assert session_owner("a8f30868") is None  # an id from before owners were named


def test_leftovers_of_a_dead_owner_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    runs, shm = tmp_path / "tmp", tmp_path / "shm"
    runs.mkdir()
    shm.mkdir()
    gone = f"{dead_pid()}p0a1b2c"
    live = f"{os.getppid()}p0a1b2c"
    dead_dir = new_run_dir(gone, runs)
    (dead_dir / "ctl.sock").touch()
    live_dir = new_run_dir(live, runs)
    dead_segment = shm / f"m3s-{gone}-123_0"
    live_segment = shm / f"m3s-{live}-123_0"
    foreign = [shm / "m3s-a8f30868-1_0", runs / "m3s-notours", shm / "other-file"]
    for path in (dead_segment, live_segment, *foreign):
        path.touch()
    assert not pid_alive(session_owner(gone) or 0)
    removed = remove_orphans(runs, shm)
    assert sorted(removed) == sorted([dead_dir, dead_segment])
    assert not dead_dir.exists() and not dead_segment.exists()
    assert live_dir.is_dir() and live_segment.exists()
    assert all(path.exists() for path in foreign)


def test_nothing_to_clean_is_fine(tmp_path: Path) -> None:
    assert remove_orphans(tmp_path / "missing", tmp_path / "also-missing") == []
