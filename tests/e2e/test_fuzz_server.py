"""The fuzz run of perf/fuzz_server.py, short: 300 requests (schemathesis cases from the server's
/openapi.json and hypothesis-made bodies) against a real `m3serve serve`; no 5xx, nothing lost,
the server alive and every process's RSS within 2x its idle size. The long run (20,000
requests) is `python perf/fuzz_server.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 300


def test_a_short_fuzz_run_gets_no_server_error(tmp_path: Path, model_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    server_args = f"--model-path {model_path} --tokenizer-worker-num 2"
    command = [sys.executable, str(ROOT / "perf" / "fuzz_server.py"), "--workers", "0"]
    command += ["--requests", str(REQUESTS), "--server-args", server_args, "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] == REQUESTS
    assert report["server_errors_5xx"] == 0, report["failures"]
    assert report["lost"] == 0, report["failures"]
    assert report["alive"]
    assert {"api", "engine", "tokenizer0", "tokenizer1"} <= report["rss_mb"].keys()
    for name, rss in report["rss_mb"].items():
        assert rss["peak"] <= 2 * rss["idle"], (name, rss)
    # Bodies reached generation, and refusals were 4xx: both kinds of answer are in the run.
    assert report["status"].get("200", 0) > REQUESTS // 10
    assert report["status"].get("400", 0) > 0
    sources = {kind.split()[0] for kind in report["status_by_kind"]}
    assert {"schemathesis", "hypothesis"} <= sources
    assert report["passed"] and run.returncode == 0
    assert report["exit_code"] == 0  # the server stopped cleanly on SIGINT after the run
