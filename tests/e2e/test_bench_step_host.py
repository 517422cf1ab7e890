"""perf/bench_step_host.py on the built-in tiny checkpoint (CPU): every batch size is timed each
way (rows into the decode graph, a built batch, drawn outside the graph: on a CPU, which has no
graphs, the same path), each part of a step's host time reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from m3serve.model.tiny.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_run_writes_each_batch_each_way_with_its_parts(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    command = [
        sys.executable, "perf/bench_step_host.py", "--model-path", str(default_model_path()),
        "--batches", "1", "2", "--context", "12", "--iters", "3", "--profile-iters", "2",
        "--out", str(out), "--no-mxfp8-bf16-copy",
    ]  # fmt: skip
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    rows = [(r["batch"], r["way"]) for r in report["rows"]]
    assert rows == [(b, way) for b in (1, 2) for way in ("rows", "batch", "eager")]
    for row in report["rows"]:
        assert row["prepare_us"] > 0 and row["run_us"] > 0
        assert row["parts_us"]["_build"] > 0 and row["parts_us"]["sampler.sample"] > 0
    assert "== cProfile, batch 1, rows, 2 steps" in run.stdout


def test_a_chunk_times_mixed_steps_with_their_attention(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    command = [
        sys.executable, "perf/bench_step_host.py", "--model-path", str(default_model_path()),
        "--batches", "2", "--context", "12", "--iters", "3", "--profile-iters", "2",
        "--chunk", "8", "--out", str(out), "--no-mxfp8-bf16-copy",
    ]  # fmt: skip
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["chunk"] == 8
    assert [(r["batch"], r["way"]) for r in report["rows"]] == [(2, "mixed")]
    parts = report["rows"][0]["parts_us"]
    # A chunk leaves the decode graph: its batch is built and each layer attends eagerly.
    assert parts["_build"] > 0 and parts["model.backend.attention"] > 0
    assert parts["sampler.sample"] > 0
