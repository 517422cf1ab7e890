"""perf/bench_tokenizer_stall.py on the built-in tiny checkpoint: both modes encode every prompt
and report each prompt's stall of the worker's loop; prompts of the length the serving benchmark
sends go to the thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from m3serve.actors.prompt import THREAD_MIN_CHARS

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_reports_inline_then_served_encoding(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    command = [sys.executable, "perf/bench_tokenizer_stall.py", "--prompts", "4", "--out", str(out)]
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [row["thread_min_chars"] for row in report["rows"]] == [1 << 40, THREAD_MIN_CHARS]
    # A 1K-word chat prompt (bench_serving's default length) is encoded off the loop as served.
    assert report["prompt_chars"] >= THREAD_MIN_CHARS
    for row in report["rows"]:
        assert 0 < row["stall_ms_median"] <= row["stall_ms_max"], row
        assert row["encode_ms_mean"] > 0, row
    assert "as served" in run.stdout
