"""Processes of `m3serve serve` dying under it: a tokenizer worker is started again (its
requests fail with a clear error, later ones succeed), a dead engine makes the server exit
non-zero for a supervisor to restart it, and a SIGKILLed API process leaves neither actor
processes nor anything in /dev/shm or the temp directory that the next start does not remove."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from helpers.serve_process import alive, running, stream_lines, wait_until

from m3serve.runtime.shm import SHM_DIR, list_session_segments, write_array

LONG = {"prompt": "Once upon a time", "max_tokens": 60000, "ignore_eos": True}
# ignore_eos: the random tiny model may sample its EOS within four tokens.
SHORT = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}


def stream_until_cut(url: str, started: threading.Event) -> list[dict[str, Any] | str]:
    events: list[dict[str, Any] | str] = []
    for event in stream_lines(url, LONG):
        events.append(event)
        started.set()
    return events


def run_long_stream(url: str) -> tuple[threading.Thread, threading.Event, list[Any]]:
    started = threading.Event()
    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.extend(stream_until_cut(url, started)), daemon=True
    )
    thread.start()
    assert started.wait(60), "the stream did not start"
    return thread, started, result


def test_a_killed_tokenizer_worker_is_restarted(tmp_path: Path, model_path: Path) -> None:
    with running(tmp_path / "serve.log", ["--model-path", str(model_path)]) as server:
        first = server.actors()["tokenizer0"]
        thread, _, events = run_long_stream(server.url)
        os.kill(first, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the stream of the dead worker did not end"
        wait_until(lambda: server.health() == 200, 120, "healthy again")
        after = httpx.post(f"{server.url}/v1/completions", json=SHORT, timeout=60)
        # The lost request was stopped in the engine too, not left decoding for nobody.
        wait_until(lambda: server.running_requests() == 0, 60, "the lost request stopped")
        restarted = server.actors()["tokenizer0"]
        server.signal(signal.SIGTERM)
        code = server.wait()
    assert events[-1] == "[DONE]"
    assert "tokenizer0 process exited unexpectedly" in events[-2]["error"]["message"]
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["finish_reason"] == "length"
    assert restarted != first
    assert code == 0, server.output()
    assert "Traceback" not in server.output()


def test_a_killed_engine_makes_the_server_exit_non_zero(tmp_path: Path, model_path: Path) -> None:
    with running(tmp_path / "serve.log", ["--model-path", str(model_path)]) as server:
        actors = server.actors()
        thread, _, events = run_long_stream(server.url)
        os.kill(actors["engine"], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the stream did not end when the engine died"
        code = server.wait()
    output = server.output()
    assert events[-1] == "[DONE]"
    assert "engine process exited unexpectedly" in events[-2]["error"]["message"]
    assert code == 1, output
    assert "m3serve: error: the engine process exited unexpectedly (exit code -9)" in output
    assert "Traceback" not in output
    wait_until(lambda: not alive(actors["tokenizer0"]), 30, "the tokenizer gone")


def test_kill_9_of_the_api_process_leaves_nothing_the_next_start_keeps(
    tmp_path: Path, model_path: Path
) -> None:
    args = ["--model-path", str(model_path)]
    with running(tmp_path / "first.log", args) as first:
        actors = first.actors()
        (run_dir,) = Path(tempfile.gettempdir()).glob(f"m3s-{first.proc.pid}p*")
        session = run_dir.name.split("-")[1]
        # A long prompt in flight at the kill: its segment has no receiver left to unlink it.
        write_array(np.arange(20000, dtype=np.int32), session)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        # The actor processes notice their parent is gone and exit.
        wait_until(lambda: not any(alive(pid) for pid in actors.values()), 30, "actors gone")
        assert run_dir.is_dir() and list_session_segments(session)
    with running(tmp_path / "second.log", args) as second:
        assert not run_dir.exists()
        if SHM_DIR.is_dir():
            assert list_session_segments(session) == []
        second.signal(signal.SIGTERM)
        assert second.wait() == 0, second.output()
