"""Shared fixtures: tiny checkpoints written once per session, keyed by their spec."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must be
# set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

from m3serve.model.tiny.checkpoint import TinySpec, make_tiny

# M3.1: every layer sparse. M3: leading full-attention layers. Both: dense first layer + MoE.
M31_SPEC = TinySpec(dtype="float32", seed=1)
M3_SPEC = TinySpec(dtype="float32", seed=2, num_layers=5, full_attention_layers=2, dense_layers=2)
QUANT_SPEC = TinySpec(dtype="bfloat16", seed=3, quant="modelopt-mixed")

# Tiny shapes gain nothing from intra-op threads, and on a shared 2-core box spinning worker
# threads make each op 10-20x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[TinySpec], Path]:
    made: dict[TinySpec, Path] = {}

    def get(spec: TinySpec) -> Path:
        if spec not in made:
            made[spec] = make_tiny(tmp_path_factory.mktemp("tiny"), spec)
        return made[spec]

    return get
