"""Fixtures of the speculative-decoding engine-core tests: the tiny DSpark checkpoint and a
factory of CPU engine cores on it, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec

from .engine_runs import SPEC, make_core


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture
def cores(path: Path) -> Iterator[Callable[..., EngineCore]]:
    made: list[EngineCore] = []

    def make(**kwargs: Any) -> EngineCore:
        made.append(make_core(path, **kwargs))
        return made[-1]

    yield make
    for core in made:
        core.close()
