"""Where m3serve keeps files between runs: the built-in tiny checkpoint, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$XDG_CACHE_HOME/m3serve, or ~/.cache/m3serve."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "m3serve"
