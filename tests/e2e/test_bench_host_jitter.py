"""perf/bench_host_jitter.py on a CPU: the pure-Python process alone (no GPU), its units timed and
its slow windows grouped into episodes, each with the share of the normal rate it got done."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_run_reports_the_python_process(tmp_path: Path) -> None:
    out = tmp_path / "jitter.json"
    command = [sys.executable, "perf/bench_host_jitter.py", "--seconds", "0.5", "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    row = report["processes"]["python"]
    assert row["units"] > 1000 and 0 < row["median_us"] <= row["p99_us"] <= row["max_us"]
    for episode in row["episodes"]:
        assert 0 <= episode["start"] < episode["stop"] and 0 <= episode["rate"] < 1
    assert "python" in run.stdout and "cuda" not in report["processes"]
