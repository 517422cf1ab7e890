"""A live `m3serve serve` for the SDK tests: real uvicorn, the multi-process engine, an API key,
both MiniMax parsers and a 64 KiB body limit, started on a free port with its log in a file; and
the `server`, `client` and `http` fixtures the SDK test files share."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest

from helpers.serve_process import alive, descendants, free_port

API_KEY = "sk-test"
MAX_REQUEST_BYTES = 65536
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    model: str  # the served model id (the model path)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> list[int]:
        """SIGINT (Ctrl-C), wait for the exit; returns the descendants still alive after it."""
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
            pytest.fail(f"m3serve serve ignored SIGINT for {STOP_TIMEOUT_S}s\n{self.log_tail()}")
        # Actor processes (and multiprocessing's resource tracker) leave once the parent is gone.
        deadline = time.monotonic() + 10.0
        while any(alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [pid for pid in family if alive(pid)]


def start_server(model_path: Path, log: Path, extra: Sequence[str] = ()) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "m3serve",
        "serve",
        "--model-path",
        str(model_path),
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--reasoning-parser",
        "minimax-m3",
        "--tool-call-parser",
        "minimax-m3",
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        *extra,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log, str(model_path))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"m3serve serve exited with {proc.returncode}\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        time.sleep(0.1)
    server.stop()
    pytest.fail(f"m3serve serve was not healthy within {START_TIMEOUT_S}s\n{server.log_tail()}")


def sdk_client(server: Server) -> openai.OpenAI:
    """The official client on the server's API key, without retries (a test sees each error)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def bearer_client(server: Server) -> httpx.Client:
    """Plain httpx with the API key, for what the SDK hides."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60.0)


Scope = Literal["module", "package"]


def sdk_fixtures(scope: Scope, extra: Sequence[str] = ()) -> tuple[Callable[..., Any], ...]:
    """The `server`, `client` (the SDK) and `http` (plain httpx) fixtures on one live server of
    `scope`, started with `extra` flags on the `model_path` fixture's checkpoint. A test module
    or conftest binds them at its top level: `server, client, http = sdk_fixtures("module")`."""

    @pytest.fixture(scope=scope, name="server")
    def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
        running = start_server(model_path, tmp_path_factory.mktemp("serve") / "server.log", extra)
        family = descendants(running.proc.pid)
        yield running
        survivors = running.stop()
        assert running.proc.returncode is not None
        assert len(family) >= 2, f"expected engine + tokenizer processes, found {family}"
        assert survivors == [], f"processes left behind: {survivors}\n{running.log_tail()}"

    @pytest.fixture(scope=scope, name="client")
    def client(server: Server) -> Iterator[openai.OpenAI]:
        with sdk_client(server) as sdk:
            yield sdk

    @pytest.fixture(scope=scope, name="http")
    def http(server: Server) -> Iterator[httpx.Client]:
        with bearer_client(server) as plain:
            yield plain

    return server, client, http
