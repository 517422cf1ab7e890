"""perf/greedy_probe.py against a real `m3serve serve` on the built-in tiny model: two runs of
one server agree token for token, and `--compare` names the first token where doctored outputs
part (exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import start_m3serve

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "greedy_probe.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_runs_agree_and_a_difference_is_named(tmp_path: Path) -> None:
    served = start_m3serve()
    try:
        first, second = tmp_path / "a.json", tmp_path / "b.json"
        for out in (first, second):
            probe = run("--url", served.url, "--out", str(out), "--max-tokens", "6")
            assert probe.returncode == 0, probe.stdout + probe.stderr
    finally:
        served.stop()
    outputs = json.loads(first.read_text())["outputs"]
    assert [o["prompt_len"] for o in outputs] == [7, 100, 333, 1000]
    assert all(len(o["tokens"]) == 6 for o in outputs)
    same = run("--compare", str(first), str(second))
    assert same.returncode == 0 and same.stdout.count("equal") == 4, same.stdout
    doctored = json.loads(second.read_text())
    doctored["outputs"][2]["tokens"][3] += "x"
    second.write_text(json.dumps(doctored))
    differ = run("--compare", str(first), str(second))
    assert differ.returncode == 1
    assert "prompt of   333 tokens: 6 tokens, differ from output token 3" in differ.stdout
