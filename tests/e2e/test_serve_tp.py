"""Serving with --tp on the CPU (gloo ranks, one engine process per rank): through `Engine`
and through `m3serve serve`, --tp 2 (with and without --ep 2) gives the greedy tokens of
--tp 1; a killed rank, follower or rank 0, fails the in-flight request within 5 s, the other
ranks exit (an idle rank 0 too: the engine stops it), and nothing (process, shared-memory
segment) is left."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.serve_process import alive, running, stream_lines, wait_until

from m3serve import Engine, EngineDeadError
from m3serve.runtime.shm import list_session_segments

PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 60000, "ignore_eos": True}


def greedy(engine: Engine) -> list[dict[str, Any]]:
    return engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[dict[str, Any]]:
    """--tp 1's greedy outputs (in this process: cheapest to start)."""
    reference = Engine(str(model_path), single_process=True)
    try:
        return greedy(reference)
    finally:
        reference.shutdown()


def generate_in_background(engine: Engine) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            engine.generate("x", LONG)
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, outcome


def test_tp_2_gives_tp_1_greedy_tokens_and_a_dead_follower_fails_requests(
    model_path: Path, expected: list[dict[str, Any]]
) -> None:
    want = [out["output_ids"] for out in expected]
    for ep in (1, 2):
        engine = Engine(str(model_path), tp_size=2, ep_size=ep)
        pids = dict(engine.async_engine.processes)
        session = engine.async_engine.supervisor.session
        try:
            assert engine.async_engine.info["tp_size"] == 2
            got = [out["output_ids"] for out in greedy(engine)]
            assert got == want, f"--tp 2 --ep {ep}"
            if ep == 2:
                worker, outcome = generate_in_background(engine)
                time.sleep(1.0)  # generation is under way
                killed_at = time.monotonic()
                os.kill(pids["rank1"], signal.SIGKILL)
                worker.join(timeout=30)
                assert not worker.is_alive(), "generate hung after a rank died"
                assert time.monotonic() - killed_at < 5.0
                assert isinstance(outcome["error"], EngineDeadError)
                assert "rank1 process exited unexpectedly" in str(outcome["error"])
                rank0 = pids["engine"]
                wait_until(lambda: not alive(rank0), 5, "rank 0 gone")  # noqa: B023
        finally:
            engine.shutdown()
        assert not any(alive(pid) for pid in pids.values())
        assert list_session_segments(session) == []


def test_an_idle_rank_0_is_stopped_when_a_follower_dies(model_path: Path) -> None:
    """With no request in flight rank 0 runs no collective and would not notice the loss: the
    engine stops it, and the next request fails at once."""
    engine = Engine(str(model_path), tp_size=2)
    pids = dict(engine.async_engine.processes)
    try:
        os.kill(pids["rank1"], signal.SIGKILL)
        wait_until(lambda: not alive(pids["engine"]), 10, "rank 0 gone")
        with pytest.raises(EngineDeadError, match="rank1 process exited unexpectedly"):
            engine.generate("x", GREEDY)
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in pids.values())


def completion_text(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_serve_tp_2_gives_tp_1_text_and_a_dead_rank_0_ends_the_server(
    tmp_path: Path, model_path: Path, expected: list[dict[str, Any]]
) -> None:
    args = ["--model-path", str(model_path), "--tp", "2"]
    with running(tmp_path / "serve.log", args) as server:
        assert [completion_text(server.url, p) for p in PROMPTS] == [e["text"] for e in expected]
        actors = server.actors()
        events: list[Any] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 60000, "ignore_eos": True}
            for event in stream_lines(server.url, body):
                events.append(event)
                started.set()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert started.wait(60), "the stream did not start"
        killed_at = time.monotonic()
        os.kill(actors["engine"], signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the stream did not end when rank 0 died"
        assert time.monotonic() - killed_at < 5.0
        wait_until(lambda: not alive(actors["rank1"]), 5, "the follower rank gone")
        code = server.wait()
    assert events[-1] == "[DONE]"
    assert "engine process exited unexpectedly" in events[-2]["error"]["message"]
    assert code == 1, server.output()
