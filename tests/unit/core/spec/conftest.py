"""Fixtures of the speculative-decoding engine-core tests: the tiny DSpark checkpoint and a
factory of CPU engine cores on it, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.core_runs import closing_cores

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec

from .engine_runs import SPEC, make_core


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture
def cores(path: Path) -> Iterator[Callable[..., EngineCore]]:
    yield from closing_cores(lambda **kwargs: make_core(path, **kwargs))
