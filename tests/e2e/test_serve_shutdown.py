"""Stopping `m3serve serve` by signal, as an operator or a process supervisor does: SIGTERM
drains (new requests and /health get 503, running streams get --graceful-shutdown-timeout to
finish, the rest end with an error event and [DONE]) and exits 0; Ctrl-C prints no traceback."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
from helpers.serve_process import alive, running, start, stream_lines, wait_until

LONG = {"prompt": "Once upon a time", "max_tokens": 60000, "ignore_eos": True}


class Streaming:
    """One streamed request read on a thread; `events` fills as its SSE data arrives."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.events: list[dict[str, Any] | str] = []
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        for event in stream_lines(url, body):
            self.events.append(event)

    def wait_started(self) -> None:
        wait_until(lambda: len(self.events) > 0, 60, "streaming")

    def join(self) -> list[dict[str, Any] | str]:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events


def test_sigterm_lets_streams_finish(tmp_path: Path, model_path: Path) -> None:
    args = ["--model-path", str(model_path), "--graceful-shutdown-timeout", "300"]
    with running(tmp_path / "serve.log", args) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
        stream = Streaming(server.url, {**body, "stream_options": {"include_usage": True}})
        stream.wait_started()
        server.signal(signal.SIGTERM)
        events = stream.join()
        assert server.wait() == 0, server.output()
    assert events[-1] == "[DONE]"
    payloads = [e for e in events if isinstance(e, dict)]
    assert not [e for e in payloads if "error" in e], payloads[-3:]
    finishes = [c["finish_reason"] for e in payloads for c in e.get("choices", [])]
    assert finishes[-1] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 200
    assert "Traceback" not in server.output()


def test_sigterm_refuses_new_requests_and_ends_late_streams_with_an_error(
    tmp_path: Path, model_path: Path
) -> None:
    args = ["--model-path", str(model_path), "--graceful-shutdown-timeout", "3"]
    with running(tmp_path / "serve.log", args) as server:
        stream = Streaming(server.url, LONG)
        collected: list[httpx.Response] = []
        whole = threading.Thread(
            target=lambda: collected.append(
                httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=120)
            )
        )
        whole.start()
        stream.wait_started()
        wait_until(lambda: server.running_requests() == 2, 60, "both requests running")
        server.signal(signal.SIGTERM)
        # Both run for far longer than the grace period: the drain is still on.
        wait_until(lambda: server.health() == 503, 30, "unhealthy while draining")
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        events = stream.join()
        whole.join(120)
        code = server.wait()
    assert refused.status_code == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and "error" in error, events[-3:]
    assert "shutting down" in error["error"]["message"]
    (cut,) = collected  # the non-streamed request: a 503 saying why, not a bare 500
    assert cut.status_code == 503, cut.text
    assert "did not finish within 3s" in cut.json()["error"]["message"]
    assert code == 0, server.output()
    assert "Traceback" not in server.output()


def test_ctrl_c_prints_no_traceback(tmp_path: Path, model_path: Path) -> None:
    args = ["--model-path", str(model_path), "--graceful-shutdown-timeout", "2"]
    with running(tmp_path / "serve.log", args) as server:
        actors = server.actors()
        stream = Streaming(server.url, LONG)
        stream.wait_started()
        # A terminal's Ctrl-C signals the whole process group, actor processes included.
        server.signal(signal.SIGINT, group=True)
        events = stream.join()
        code = server.wait()
    assert events[-1] == "[DONE]"
    assert code == 0, server.output()
    output = server.output()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert len(actors) == 2
    wait_until(lambda: not any(alive(pid) for pid in actors.values()), 30, "actors gone")


def test_ctrl_c_during_start_up_prints_no_traceback(tmp_path: Path, model_path: Path) -> None:
    server = start(tmp_path / "serve.log", ["--model-path", str(model_path)], ready=False)
    try:
        wait_until(lambda: len(server.actors()) == 2, 60, "spawning actors")
        actors = server.actors()
        server.signal(signal.SIGINT, group=True)
        code = server.wait()
    finally:
        if server.proc.poll() is None:
            server.kill()
    output = server.output()
    assert code == 0, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    wait_until(lambda: not any(alive(pid) for pid in actors.values()), 30, "actors gone")
