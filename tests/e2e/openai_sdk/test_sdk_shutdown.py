"""Ctrl-C stops a live server cleanly."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
from helpers.sdk_server import Server, start_server
from helpers.serve_process import descendants

# ---------------------------------------------------------------------- shutdown


def test_ctrl_c_shuts_the_server_down_cleanly(
    model_path: Path, tmp_path: Path, server: Server
) -> None:
    """SIGINT (Ctrl-C) stops uvicorn and the engine, leaves no process behind and prints no
    traceback. Its own server, so the module's server stays up for the other tests."""
    own = start_server(model_path, tmp_path / "server.log")
    family = descendants(own.proc.pid)
    assert len(family) >= 2
    assert httpx.get(f"{own.url}/health").status_code == 200
    survivors = own.stop()
    log = own.log_tail()
    assert survivors == []
    assert "Application shutdown complete" in log
    assert own.proc.returncode in (0, -signal.SIGINT, 128 + signal.SIGINT)
    assert "Traceback" not in log, log[log.find("Traceback") :][-1500:]
