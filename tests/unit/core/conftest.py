"""A CPU engine core on the tiny checkpoint, shared by the engine-core tests of a module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import M31_SPEC

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs


@pytest.fixture(scope="module")
def core(tiny_checkpoint: Callable[[TinySpec], Path]) -> Iterator[EngineCore]:
    path = tiny_checkpoint(M31_SPEC)
    args = ServerArgs.from_kwargs(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048
    )
    engine = EngineCore(args, path)
    yield engine
    engine.close()
