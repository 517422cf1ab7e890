"""What an operator sees when `m3serve serve` starts: the weight-loading progress in the
server log (the engine process loads the weights; its progress must reach the same log)."""

from __future__ import annotations

import signal
from pathlib import Path

from helpers.serve_process import running


def test_weight_loading_progress_is_in_the_server_log(tmp_path: Path, model_path: Path) -> None:
    with running(tmp_path / "serve.log", ["--model-path", str(model_path)]) as server:
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
    lines = server.output().splitlines()
    loading = [line for line in lines if "[engine]" in line and ": Loading weights: " in line]
    assert loading, "no weight-loading progress in the log"
    assert loading[0].rsplit(": ", 1)[1].startswith("0/")
    assert "Loading weights: 100% (" in loading[-1]
    ready = next(i for i, line in enumerate(lines) if "ready on http://" in line)
    assert lines.index(loading[-1]) < ready
