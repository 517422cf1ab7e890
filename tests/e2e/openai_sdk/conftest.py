"""The live server the openai SDK tests share: one `m3serve serve` for the whole directory (real
uvicorn, the multi-process engine, API key, both MiniMax parsers and a 64 KiB body limit, on the
tiny random checkpoint), an SDK client and a plain httpx client with the key.

The tiny model writes gibberish, so tests pin down shapes, types, usage arithmetic and
stream/non-stream agreement at temperature 0 — never meaning.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.sdk_server import Server, bearer_client, sdk_client, start_server
from helpers.serve_process import descendants


@pytest.fixture(scope="package")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(model_path, tmp_path_factory.mktemp("serve") / "server.log")
    family = descendants(running.proc.pid)
    yield running
    survivors = running.stop()
    assert running.proc.returncode is not None
    assert len(family) >= 2, f"expected engine + tokenizer processes, found {family}"
    assert survivors == [], f"processes left behind: {survivors}\n{running.log_tail()}"


@pytest.fixture(scope="package")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with sdk_client(server) as sdk:
        yield sdk


@pytest.fixture(scope="package")
def http(server: Server) -> Iterator[httpx.Client]:
    with bearer_client(server) as plain:
        yield plain
