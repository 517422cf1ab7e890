"""perf/bench_tp_decode.py on the CPU (gloo ranks, the reference backend, the built-in tiny
checkpoint): tp 1 and tp 2 each give a row per batch with its time per layer, and tp 2's greedy
tokens equal tp 1's on every row (the KV cache is seeded per global head, so both hold the same
cache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3serve.model.tiny.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tp_2_rows_match_tp_1_greedy_tokens(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    command = [
        sys.executable, "perf/bench_tp_decode.py", "--model-path", str(default_model_path()),
        "--tps", "1", "2", "--batches", "1", "3", "--context", "40", "--device", "cpu",
        "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert [r["greedy_equal"] for r in rows] == ["1/1", "3/3", "1/1", "3/3"]
    assert all(r["us_per_layer"] > 0 and r["nccl_share"] is None for r in rows)
    assert "us/layer" in run.stdout
