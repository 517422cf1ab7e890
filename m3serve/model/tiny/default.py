"""The built-in default model: a tiny checkpoint generated once into the user's cache directory,
so `m3serve generate` / `m3serve serve` work with no download on a laptop CPU."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from m3serve.model.tiny.checkpoint import TinySpec, make_tiny
from m3serve.runtime.paths import cache_root

DEFAULT_SPEC = TinySpec(seed=31)


def default_model_path(spec: TinySpec = DEFAULT_SPEC, root: Path | None = None) -> Path:
    """Path of the built-in checkpoint, writing it on first use (safe across processes)."""
    root = root or cache_root()
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    target = root / f"tiny-m3.1-{digest}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            # Write next to the target and rename, so a reader never sees a half-written model.
            staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
            try:
                make_tiny(staging, spec)
                staging.rename(target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return target
