"""The checkpoint and reference model the engine tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.hf_oracle import load_ours

from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec

ENGINE_SPEC = TinySpec(dtype="float32", seed=1)


@pytest.fixture(scope="session")
def model_path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(ENGINE_SPEC)


@pytest.fixture(scope="session")
def model(model_path: Path) -> M3ForCausalLM:
    """The same checkpoint through the plain model loop: what the engine must reproduce."""
    return load_ours(model_path)
