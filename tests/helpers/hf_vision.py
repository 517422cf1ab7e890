"""transformers' MiniMax-M3.1 image / video processors and processor as an oracle.

They run on torchvision, whose PyPI wheel is built against CUDA torch and cannot load its C ops
next to the CPU torch CI uses. Its Python code (all the processors call) works without them, so
the wheel is installed to a directory of its own (`.oracle/torchvision`, see .ci/run) and used
only in a child process, never in the test process: there transformers would see torchvision
and other HF paths might try its ops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
ORACLE_SCRIPT = Path(__file__).with_name("hf_vision_oracle.py")


def torchvision_dir() -> Path | None:
    """Where the oracle's torchvision is (M3SERVE_TORCHVISION_DIR or .oracle/torchvision)."""
    given = os.environ.get("M3SERVE_TORCHVISION_DIR")
    path = Path(given) if given else REPO / ".oracle" / "torchvision"
    return path if (path / "torchvision").is_dir() else None


def need_torchvision() -> Path:
    path = torchvision_dir()
    if path is None:
        pytest.skip("the HF image-processor oracle needs torchvision in .oracle/torchvision")
    return path


def run_oracle(job: dict[str, Any], workdir: Path) -> dict[str, np.ndarray]:
    """Run one oracle job (see hf_vision_oracle.py) in a child process; its arrays back."""
    path = need_torchvision()
    job_file = workdir / "job.json"
    out_file = workdir / "out.npz"
    job_file.write_text(json.dumps({**job, "out": str(out_file)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, str(ORACLE_SCRIPT), str(job_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(f"HF oracle failed:\n{done.stderr[-4000:]}")
    with np.load(out_file) as data:
        return {key: data[key] for key in data.files}
