"""Where the API key comes from: `--api-key`, else `--api-key-file`, else the M3SERVE_API_KEY
environment variable (as vLLM reads VLLM_API_KEY), so that it need not be in the command line,
which `ps` shows to every user of the machine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from m3serve.runtime.config import ApiArgs, ConfigInvalid

ENV_VAR = "M3SERVE_API_KEY"


def read_api_key(args: ApiArgs, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key every request must carry, or None for an open server."""
    if args.api_key is not None:
        return args.api_key
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ConfigInvalid(f"--api-key-file {path}: {exc.strerror}") from exc
        if not key:
            raise ConfigInvalid(f"--api-key-file {path} is empty")
        return key
    return environ.get(ENV_VAR) or None
