"""The engine process's switch to prometheus_client's multiprocess mode: metrics made after it
land in files under the given directory, also when prometheus_client was imported first (as a
spawned child's re-import of the parent's `__main__` can do)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

CHILD = """
import sys
from pathlib import Path

if sys.argv[2] == "imported-first":
    import prometheus_client  # noqa: F401

from m3serve.engine.launch import _write_metrics_to

_write_metrics_to(Path(sys.argv[1]))
from m3serve.actors.engine_metrics import EngineMetrics

metrics = EngineMetrics()
metrics.running.set(3)
metrics.retractions.inc(2)
"""


@pytest.mark.parametrize("order", ["imported-first", "imported-after"])
def test_engine_metrics_are_written_to_the_directory(tmp_path: Path, order: str) -> None:
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), order], check=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("m3serve:num_running_reqs") == 3
    assert registry.get_sample_value("m3serve:num_retractions_total") == 2
