"""Server subprocesses for the benchmarks in perf/: start a command that serves HTTP on a free
port, wait for GET /health to answer 200, read its CPU time from /proc, stop it with SIGINT.

Import it from a benchmark run as `python perf/bench_x.py` (perf/ is then on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

# A GPU server compiles its Triton kernels and captures CUDA graphs before /health answers:
# minutes on a cold kernel cache.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Served:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: IO[bytes]

    def api_cpu_s(self) -> float:
        """CPU seconds of the server process itself (the API layer)."""
        return cpu_s(self.proc.pid)

    def total_cpu_s(self) -> float:
        """CPU seconds of the server process and every process below it (the engine)."""
        return sum(cpu_s(pid) for pid in [self.proc.pid, *descendants(self.proc.pid)])

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        # Taken before the signal: once the parent is gone its children can no longer be found.
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for pid in family:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self.log.close()


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                ids = [int(c) for c in children.read_text().split()]
                found += ids
                todo += ids
    return found


def start(
    name: str, command: Sequence[str], port: int, timeout_s: float = START_TIMEOUT_S
) -> Served:
    """Run `command` (which must listen on 127.0.0.1:`port`) until /health answers 200."""
    # A file, not a pipe: nothing to drain, readable on failure; closed by Served.stop.
    log = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(list(command), stdout=subprocess.DEVNULL, stderr=log)
    served = Served(name, proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = served.log_tail()
            served.stop()
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{err}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{served.url}/health", timeout=2.0).status_code == 200:
                return served
        time.sleep(0.1)
    err = served.log_tail()
    served.stop()
    raise RuntimeError(f"{name} was not healthy within {timeout_s}s:\n{err}")


def m3serve_command(port: int, server_args: Sequence[str] = ()) -> list[str]:
    """`python -m m3serve serve` on 127.0.0.1:`port`, quiet, with the caller's serve flags."""
    command = [sys.executable, "-m", "m3serve", "--log-level", "warning", "serve"]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *server_args]


def start_m3serve(server_args: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S) -> Served:
    port = free_port()
    return start("m3serve", m3serve_command(port, server_args), port, timeout_s)
