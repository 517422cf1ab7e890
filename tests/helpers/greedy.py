"""Greedy runs of a checkpoint through the Engine, and where two token streams part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m3serve import Engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}


def engine_outputs(
    path: Path, prompts: list[list[int]], **server_args: object
) -> tuple[list[list[int]], dict[str, Any]]:
    """Each prompt's greedy output ids (one single-process engine), and the engine's info.
    The warm-up is skipped unless asked for: these compare tokens, and the warm-up has its own
    test (tests/gpu/test_no_compiles_after_ready.py)."""
    server_args.setdefault("skip_warmup", True)
    with Engine(str(path), single_process=True, max_total_tokens=65536, **server_args) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        info = engine.server_info
    return [r["output_ids"] for r in results], info


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
