"""Start-up, failure and shutdown: a killed engine process fails pending requests quickly, and
shutdown leaves no child process, socket file or shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from m3serve import Engine, EngineDeadError, RequestError
from m3serve.model.locate import ModelNotFound
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ConfigInvalid
from m3serve.runtime.shm import list_session_segments
from m3serve.runtime.supervisor import StartupError

SPEC = TinySpec(dtype="float32", seed=1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for every purpose but reaping.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_shutdown_leaves_no_process_socket_or_segment(model_path: Path) -> None:
    engine = Engine(str(model_path), tokenizer_worker_num=2)
    pids = list(engine.async_engine.processes.values())
    session = engine.async_engine.supervisor.session
    run_dir = engine.async_engine.supervisor.run_dir
    assert len(pids) == 3 and all(alive(pid) for pid in pids)
    engine.generate("hello", {"max_new_tokens": 4})
    engine.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert not run_dir.exists()
    assert list_session_segments(session) == []


def test_killing_the_engine_process_fails_pending_requests_fast(model_path: Path) -> None:
    engine = Engine(str(model_path))
    try:
        pid = engine.async_engine.processes["engine"]
        outcome: dict[str, object] = {}

        def run() -> None:
            started = time.monotonic()
            try:
                engine.generate("x", {"max_new_tokens": 60000, "ignore_eos": True})
                outcome["error"] = None
            except Exception as exc:
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(1.0)  # generation is under way
        metrics = engine.async_engine.metrics
        assert metrics is not None
        assert metrics.get_sample_value("m3serve:num_running_reqs") == 1
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        worker.join(timeout=30)
        assert not worker.is_alive(), "generate hung after the engine died"
        assert isinstance(outcome["error"], EngineDeadError)
        assert "engine process exited" in str(outcome["error"])
        assert time.monotonic() - killed_at < 5.0
        with pytest.raises(EngineDeadError):
            engine.generate("after", {"max_new_tokens": 1})
        # A dead engine runs nothing: its gauges are gone from the metrics, its counters stay.
        assert metrics.get_sample_value("m3serve:num_running_reqs") is None
        assert metrics.get_sample_value("m3serve:num_retractions_total") == 0
    finally:
        pids = list(engine.async_engine.processes.values())
        session = engine.async_engine.supervisor.session
        engine.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert list_session_segments(session) == []


def test_start_up_failure_names_the_problem(tmp_path: Path, model_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_path / "config.json").read_text())
    (broken / "tokenizer.json").write_text((model_path / "tokenizer.json").read_text())
    with pytest.raises(StartupError, match=r"no model\.safetensors"):
        Engine(str(broken), startup_timeout=60)
    with pytest.raises(ModelNotFound, match="not a local directory"):
        Engine(str(tmp_path / "missing"))
    with pytest.raises(ConfigInvalid, match="--tp 3 --ep 1 cannot run this model: "):
        Engine(str(model_path), tp_size=3)


def test_skip_tokenizer_init_serves_token_ids_only(model_path: Path, tmp_path: Path) -> None:
    ids_only = tmp_path / "ids-only"
    ids_only.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (ids_only / name).symlink_to(model_path / name)
    with Engine(str(ids_only), single_process=True, skip_tokenizer_init=True) as engine:
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"temperature": 0})
        assert out["text"] == "" and len(out["output_ids"]) > 0
        with pytest.raises(RequestError, match="send input_ids"):
            engine.generate("text needs a tokenizer")
