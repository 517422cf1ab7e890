"""`m3serve serve` as a real subprocess on a free port, for tests of signals, faults and exit
codes: started in its own session (so a test can signal its whole process group, as Ctrl-C in a
terminal does), its output in a file, its actor processes found through /proc."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from helpers.metrics_text import samples

START_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc/<pid>/task/*/children."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                ids = [int(c) for c in children.read_text().split()]
                found += ids
                todo += ids
    return found


def alive(pid: int) -> bool:
    # A zombie still has a /proc entry; it is gone for every purpose but reaping.
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout:.0f}s")
        time.sleep(0.05)


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> int | None:
        """/health's status code; None while nothing answers."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.TransportError:
            return None

    def running_requests(self) -> float:
        """The engine's running requests, from /metrics."""
        metrics = samples(httpx.get(f"{self.url}/metrics", timeout=10).text)
        return sum(v for k, v in metrics.items() if k.startswith("m3serve:num_running_reqs"))

    def actors(self) -> dict[str, int]:
        """Actor process name -> pid, from the supervisor's start-up log lines."""
        found: dict[str, int] = {}
        for line in self.output().splitlines():
            if "m3serve.runtime.supervisor: started " in line:
                name, _, pid = line.split("started ", 1)[1].partition(" (pid ")
                found[name] = int(pid.rstrip(")"))
        return found

    def signal(self, sig: int, group: bool = False) -> None:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"m3serve serve still running\n{self.output()[-6000:]}") from None

    def kill(self) -> None:
        """SIGKILL the whole family (a test's last resort)."""
        family = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def start(
    log: Path, args: Sequence[str] = (), port: int | None = None, ready: bool = True
) -> ServeProcess:
    """`python -m m3serve serve` with `args`; with `ready`, wait until /health answers 200."""
    port = port or free_port()
    command = [sys.executable, "-m", "m3serve", "serve", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    served = ServeProcess(proc, port, log)
    if ready:
        try:
            wait_until(
                lambda: proc.poll() is not None or served.health() == 200,
                START_TIMEOUT_S,
                "healthy",
            )
        except AssertionError:
            served.kill()
            raise
        if proc.poll() is not None:
            raise AssertionError(f"m3serve serve exited with {proc.returncode}\n{served.output()}")
    return served


@contextlib.contextmanager
def running(log: Path, args: Sequence[str] = ()) -> Iterator[ServeProcess]:
    served = start(log, args)
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.kill()


def stream_lines(
    url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> Iterator[dict[str, Any] | str]:
    """The SSE data of a streamed request as it arrives: JSON payloads, then "[DONE]"."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                yield data if data == "[DONE]" else json.loads(data)
