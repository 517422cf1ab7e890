"""Loading a checkpoint onto a backend: the quantized weights stay as stored (the device holds
about the checkpoint's bytes), and the load line reports both sizes and the read rate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from m3serve.backends.hopper import HopperBackend
from m3serve.backends.reference import ReferenceBackend
from m3serve.model.build import checkpoint_bytes, load_model, weight_bytes
from m3serve.model.tiny.checkpoint import TinySpec, make_tiny

# Wide enough that the quantized projections and experts, not the norms, are most of the bytes.
SPEC = TinySpec(
    dtype="bfloat16", seed=3, quant="modelopt-mixed", hidden_size=128, intermediate_size=128
)


def test_quantized_weights_held_as_stored_take_the_checkpoints_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = make_tiny(tmp_path / "q", SPEC)
    caplog.set_level(logging.INFO, logger="m3serve.model.build")
    backend = HopperBackend(torch.device("cpu"), interpreter=True)
    loaded = load_model(path, backend, "bfloat16", progress=False)
    held, stored = weight_bytes(loaded.model), checkpoint_bytes(path)
    assert stored == sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert abs(held - stored) <= 0.1 * stored
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    assert f"weights {held / 1e6:.1f} MB on the device" in line
    assert f"checkpoint {stored / 1e6:.1f} MB" in line and "GB/s" in line
    # Dequantized to fp32 (the CPU reference), the same checkpoint takes several times more.
    dense = load_model(path, ReferenceBackend(torch.device("cpu")), "float32", progress=False)
    assert weight_bytes(dense.model) > 3 * stored


def test_weight_bytes_counts_a_shared_storage_once() -> None:
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.zeros(10, 4))
    module.register_buffer("view", module.a.data[2:5])
    assert weight_bytes(module) == 10 * 4 * 4
