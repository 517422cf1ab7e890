"""--tp 4 on the CPU (four gloo ranks, one engine process each) serving the ModelOpt
mixed-precision tiny checkpoint (MXFP8 projections, NVFP4 experts), with and without --ep:
through `Engine` and through `m3serve serve`, the greedy tokens of --tp 1, and a shutdown that
leaves no rank process or shared-memory segment behind. (--tp 2, the bf16 checkpoints and the
killed ranks: test_serve_tp.py; the logits at tp 2 and 4: test_tensor_parallel.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.serve_process import alive, running
from helpers.tp_runs import MIXED

from m3serve import Engine
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.shm import list_session_segments

PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def mixed_path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(MIXED)


@pytest.fixture(scope="module")
def expected(mixed_path: Path) -> list[dict[str, Any]]:
    """--tp 1's greedy outputs (in this process: cheapest to start)."""
    reference = Engine(str(mixed_path), single_process=True)
    try:
        return reference.generate(PROMPTS, GREEDY)
    finally:
        reference.shutdown()


@pytest.mark.parametrize("ep", [1, 4])
def test_tp_4_on_the_quantized_checkpoint_gives_tp_1_greedy_tokens(
    mixed_path: Path, expected: list[dict[str, Any]], ep: int
) -> None:
    engine = Engine(str(mixed_path), tp_size=4, ep_size=ep)
    pids = dict(engine.async_engine.processes)
    session = engine.async_engine.supervisor.session
    try:
        assert engine.async_engine.info["tp_size"] == 4
        assert {f"rank{r}" for r in (1, 2, 3)} <= set(pids)
        got = [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]
        assert got == [out["output_ids"] for out in expected]
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in pids.values())
    assert list_session_segments(session) == []


def test_serve_tp_4_ep_2_on_the_quantized_checkpoint_gives_tp_1_text(
    tmp_path: Path, mixed_path: Path, expected: list[dict[str, Any]]
) -> None:
    args = ["--model-path", str(mixed_path), "--tp", "4", "--ep", "2"]
    with running(tmp_path / "serve.log", args) as server:
        texts = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        actors = server.actors()
        assert {f"rank{r}" for r in (1, 2, 3)} <= set(actors)
        server.signal(2)  # SIGINT, as Ctrl-C
        assert server.wait() == 0, server.output()
    assert texts == [out["text"] for out in expected]
    assert not any(alive(pid) for pid in actors.values())
