"""The README's library snippets run as pasted: each Python block that imports m3serve runs as
a script of its own, in a fresh interpreter (its actor processes are spawned, so it must carry
its own `__main__` guard), on the built-in tiny checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNIPPET_TIMEOUT_S = 300


def library_snippets() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b for b in blocks if re.search(r"^(import|from) m3serve", b, re.M)]


def test_the_readme_has_an_engine_and_an_async_engine_snippet() -> None:
    snippets = library_snippets()
    assert any("m3serve.Engine(" in s for s in snippets)
    assert any("AsyncEngine.create(" in s for s in snippets)
    assert all('if __name__ == "__main__":' in s for s in snippets)


@pytest.mark.parametrize("index", range(len(library_snippets())))
def test_a_readme_snippet_runs_as_pasted(index: int, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(library_snippets()[index])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's m3serve, as if installed
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip(), "every snippet prints its results"
    assert "Traceback" not in done.stderr
