"""Turning `--model-path` (+ `--revision`) into a local checkpoint directory.

A directory is used as it is. A Hub id (`org/name`) is looked up in the local Hugging Face cache
at the requested revision; m3serve never downloads, so a missing model is a clear error that
says how to fetch it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class ModelNotFound(FileNotFoundError):
    """The model path is neither a directory nor a cached Hub snapshot."""


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def resolve_model_path(model_path: str | Path, revision: str | None = None) -> Path:
    path = Path(model_path).expanduser()
    if path.is_dir():
        if revision:
            log.info("%s is a local directory; --revision %s is not checked", path, revision)
        return path
    repo = hub_cache_dir() / ("models--" + str(model_path).replace("/", "--"))
    snapshot = _snapshot(repo, revision or "main")
    if snapshot is None:
        fetch = f"hf download {model_path}"
        if revision:
            fetch += f" --revision {revision}"
        raise ModelNotFound(
            f"model {model_path!r} is not a local directory and not in the Hugging Face cache "
            f"({repo}); m3serve does not download models: run `{fetch} --local-dir DIR` and "
            "pass --model-path DIR"
        )
    return snapshot


def _snapshot(repo: Path, revision: str) -> Path | None:
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    candidates = [repo / "snapshots" / commit]
    if len(revision) < 40:  # an abbreviated commit hash
        candidates += sorted((repo / "snapshots").glob(f"{revision}*"))
    return next((c for c in candidates if (c / "config.json").is_file()), None)
