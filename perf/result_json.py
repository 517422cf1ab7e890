"""Where a benchmark's JSON goes: `--out` when given, else $OUT (the folder a device run sends
back), else perf/results/. Import it from a benchmark run as `python perf/bench_x.py`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_result(result: dict[str, Any], name: str, out: Path | None = None) -> Path:
    """Write `result` as `name` (e.g. "bench_router.json") and say where."""
    if out is not None:
        path = out
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / name
    else:
        path = Path(__file__).parent / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path
