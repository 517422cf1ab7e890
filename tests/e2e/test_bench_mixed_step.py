"""perf/bench_mixed_step.py on the built-in tiny checkpoint (CPU): every batch gets its pure
decode step and one mixed step per chunk, and the fit's fixed cost is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from m3serve.model.tiny.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_run_writes_a_row_per_batch_and_chunk(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    command = [
        sys.executable, "perf/bench_mixed_step.py", "--model-path", str(default_model_path()),
        "--batches", "1", "3", "--chunks", "8", "16", "--context", "12", "--top", "3",
        "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [(r["batch"], r["chunk"]) for r in report["rows"]] == [
        (b, c) for b in (1, 3) for c in (0, 8, 16)
    ]
    assert all(r["wall_ms"] > 0 and r["host_ms"] > 0 for r in report["rows"])
    assert all("fixed_ms" in r for r in report["rows"] if r["chunk"])
    assert report["prefill_ms_per_token"] > 0
    assert "fixed cost per mixed step" in run.stdout and "top ops" in run.stdout
