"""Loading a checkpoint onto a backend: the quantized weights stay as stored (the device holds
about the checkpoint's bytes; the hopper backend tiles the NVFP4 experts' rows, values
unchanged), and the load line reports both sizes and the read rate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from m3serve.backends.hopper import HopperBackend
from m3serve.backends.reference import ReferenceBackend, dequant_experts
from m3serve.kernels.quant import dequant_mxfp8
from m3serve.model.build import checkpoint_bytes, load_model, weight_bytes
from m3serve.model.ffn import Experts
from m3serve.model.params import Linear
from m3serve.model.tiny.checkpoint import TinySpec, make_tiny
from m3serve.model.weights import ExpertWeights, Mxfp8Weight, Nvfp4Experts

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


def test_the_hopper_backend_holds_nvfp4_experts_row_tiled_with_the_same_values(
    tmp_path: Path,
) -> None:
    path = make_tiny(tmp_path / "q", SPEC)
    hopper = load_model(path, HopperBackend(torch.device("cpu"), interpreter=True), "bfloat16")
    stored = load_model(path, ReferenceBackend(torch.device("cpu"), keep_quantized=True))
    for held, plain in nvfp4_experts(hopper.model, stored.model):
        assert isinstance(held, Nvfp4Experts) and isinstance(plain, Nvfp4Experts)
        assert held.tiled and not plain.tiled and held.w13.dim() == 5
        got, want = dequant_experts(held, torch.float32), dequant_experts(plain, torch.float32)
        assert torch.equal(got.w13, want.w13) and torch.equal(got.w2, want.w2)


def test_the_bf16_copy_holds_each_mxfp8_projection_dequantized_beside_its_codes(
    tmp_path: Path,
) -> None:
    """`--mxfp8-bf16-copy`: every MXFP8 projection also holds W in bf16 (the exact dequantized
    values), which the backend's `linear` reads, and the load's byte count includes it."""
    path = make_tiny(tmp_path / "q", SPEC)
    plain = load_model(path, HopperBackend(torch.device("cpu"), interpreter=True), "bfloat16")
    backend = HopperBackend(torch.device("cpu"), interpreter=True, mxfp8_bf16_copy=True)
    copied = load_model(path, backend, "bfloat16")
    linears = [m for m in copied.model.modules() if isinstance(m, Linear) and m.fmt == "MXFP8"]
    assert linears, "the checkpoint has MXFP8 projections"
    for linear in linears:
        held = linear.data
        assert isinstance(held, Mxfp8Weight) and held.bf16 is linear.weight_bf16
        want = dequant_mxfp8(linear.weight, linear.weight_scale).to(torch.bfloat16)
        assert held.bf16 is not None and torch.equal(held.bf16, want)
    extra = sum(2 * m.weight.numel() for m in linears)
    assert weight_bytes(copied.model) == weight_bytes(plain.model) + extra
    without = [m.data for m in plain.model.modules() if isinstance(m, Linear) and m.fmt == "MXFP8"]
    assert all(isinstance(w, Mxfp8Weight) and w.bf16 is None for w in without)


def test_dequant_experts_gives_the_values_the_loader_dequantizes_to(tmp_path: Path) -> None:
    """The experts kept as NVFP4 and decoded one at a time (`dequant_experts`) hold exactly the
    values that loading the same checkpoint dequantized (`dequant_nvfp4`) gives."""
    path = make_tiny(tmp_path / "q", SPEC)
    kept = load_model(path, ReferenceBackend(torch.device("cpu"), keep_quantized=True))
    dense = load_model(path, ReferenceBackend(torch.device("cpu")), "float32", progress=False)
    for quantized, values in nvfp4_experts(kept.model, dense.model):
        assert isinstance(quantized, Nvfp4Experts) and not isinstance(values, Nvfp4Experts)
        got = dequant_experts(quantized, torch.float32)
        assert torch.equal(got.w13, values.w13) and torch.equal(got.w2, values.w2)


def nvfp4_experts(
    ours: torch.nn.Module, theirs: torch.nn.Module
) -> list[tuple[ExpertWeights, ExpertWeights]]:
    """The expert weights of each NVFP4 `Experts` module of `ours` beside the same module's in
    `theirs` (the same checkpoint loaded another way); at least one pair."""
    pairs = [
        (mine.data, other.data)
        for mine, other in zip(ours.modules(), theirs.modules(), strict=True)
        if isinstance(mine, Experts) and mine.fmt == "NVFP4"
    ]
    assert pairs, "the checkpoint has NVFP4 experts"
    return pairs
