"""Once `/health` is 200, no request waits for a Triton compile: the server, on the Hopper
backend with the model's real attention shapes, restarted so that its warm-up runs only the
plans its first start recorded (core/warmup_record.py), is sent prompts of 24 lengths from 1
to 16K tokens and bursts of 1 to the maximum concurrent requests, and its
`m3serve:kernel_compiles_after_ready_total` counter stays 0 (Triton's post-compile hook counts
every compile and every load from the disk cache).

With speculative decoding on (the checkpoint's DSpark draft, `--speculative-algorithm DSPARK`)
the same holds for verify steps of every batch size, verify rows beside prefill chunks and
beside plain decode rows (requests with penalties or logprobs stay off speculation), and
sampled requests, whose proposals run eagerly (core/spec/warmup.py)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from helpers.serve_process import free_port

from m3serve.model.tiny.checkpoint import TinySpec

# M3.1's attention and indexer shapes (64 / 4 heads of 128, pages of 128, top-16 blocks, four
# index heads of 128), narrower MLPs, quantized like the real checkpoint.
SPEC = TinySpec(
    dtype="bfloat16",
    seed=11,
    quant="modelopt-mixed",
    hidden_size=2048,
    num_layers=2,
    num_heads=64,
    num_kv_heads=4,
    head_dim=128,
    rotary_dim=64,
    dense_intermediate_size=1024,
    intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=4,
    index_head_dim=128,
    index_block_size=128,
    index_topk_blocks=16,
    max_position_embeddings=32768,
)
# The same target with a DSpark draft of the real draft's 4096-token window.
DSPARK_SPEC = replace(SPEC, seed=12, dspark=True, dspark_window=4096)
MAX_RUNNING = 32
CONTEXT = 20000
LENGTHS = sorted({1, 2, 3, 16, 17, 100, 127, 128, 129, 500, 1000, 2047, 2048, 2049, 3000,
                  4096, 5000, 8191, 8192, 8193, 10000, 12345, 15000, 16000})  # fmt: skip
BURSTS = [1, 2, 3, 5, 8, 13, 21, MAX_RUNNING]
START_TIMEOUT_S = 900.0  # a cold compile cache: the warm-up compiles every variant


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[[TinySpec], Path]) -> Iterator[tuple[str, Path]]:
    yield from _restarted(tiny_checkpoint(SPEC))


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoint: Callable[[TinySpec], Path]) -> Iterator[tuple[str, Path]]:
    yield from _restarted(tiny_checkpoint(DSPARK_SPEC), "--speculative-algorithm", "DSPARK")


def _restarted(checkpoint: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    """The server's second start, the one checked: it runs only the warm-up plans that the
    first start's record names (core/warmup_record.py)."""
    with _serve(checkpoint, *flags):
        pass
    with _serve(checkpoint, *flags) as running:
        yield running


@contextmanager
def _serve(checkpoint: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    command = [
        sys.executable, "-m", "m3serve", "serve", "--model-path",
        str(checkpoint), "--backend", "hopper", "--port", str(port),
        "--max-running-requests", str(MAX_RUNNING), "--context-length", str(CONTEXT), *flags,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not _healthy(url):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "not ready in time:\n" + log_path.read_text()
            time.sleep(1.0)
        yield url, log_path
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


async def _complete(
    client: httpx.AsyncClient, length: int, rng: random.Random, spec: bool = False
) -> None:
    prompt = [rng.randrange(1, SPEC.vocab_size - 64) for _ in range(length)]
    # With speculation, long enough outputs for many verify steps; some requests decode one
    # token per step beside the verify rows (penalties and logprobs stay off speculation).
    max_tokens = rng.choice([1, 4, 16, 40] if spec else [1, 4, 16])
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}  # fmt: skip
    if spec and rng.random() < 0.2:
        body["frequency_penalty" if rng.random() < 0.5 else "logprobs"] = 1
    response = await client.post("/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text


async def _traffic(url: str, spec: bool = False) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url) as client:
        for length in LENGTHS:
            await _complete(client, length, rng, spec)
        for burst in BURSTS:
            lengths = [rng.choice(LENGTHS) if rng.random() < 0.3 else rng.randint(1, 300)
                       for _ in range(burst)]  # fmt: skip
            await asyncio.gather(*(_complete(client, n, rng, spec) for n in lengths))


def _compiles_after_ready(url: str) -> float:
    return _metric(url, "m3serve:kernel_compiles_after_ready_total")


def _metric(url: str, name: str) -> float:
    """The sum of a /metrics sample over its label sets."""
    values = [
        float(line.split()[-1])
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        if line.split("{")[0].split(" ")[0] == name
    ]
    assert values, f"/metrics has no {name}"
    return sum(values)


def test_nothing_compiles_after_ready(server: tuple[str, Path]) -> None:
    _check_no_compiles(*server, spec=False)


def test_nothing_compiles_after_ready_with_speculative_decoding(
    spec_server: tuple[str, Path],
) -> None:
    url, log_path = spec_server
    _check_no_compiles(url, log_path, spec=True)
    # Verify steps did run: each verify row of a request is one observation.
    assert _metric(url, "m3serve:spec_accept_length_count") > 0, "no verify step ran"


def _check_no_compiles(url: str, log_path: Path, spec: bool) -> None:
    asyncio.run(_traffic(url, spec))
    stalls = [line for line in log_path.read_text().splitlines() if "compile stalls" in line]
    assert _compiles_after_ready(url) == 0, "\n".join(stalls[:20])
    assert not stalls
    startup = [line for line in log_path.read_text().splitlines() if "start-up" in line]
    print("\n".join(startup))
    assert any(" plans on layers" in line for line in startup), "the warm-up ran no record"
