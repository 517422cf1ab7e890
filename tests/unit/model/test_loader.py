"""The checkpoint loader: every way a checkpoint can disagree with its config is reported as one
CheckpointError / ConfigError naming the problem, and a good checkpoint fills every parameter
with exactly the stored values whatever the layout (single file, shards) or target dtype."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.devices import CPU_REFERENCE
from helpers.param_names import destination, param_block
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from m3serve.model.build import load_model
from m3serve.model.config import ConfigError, load_model_config
from m3serve.model.loader import CheckpointError, load_weights
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec

# Same values as conftest's specs, so the session fixture shares the checkpoints it writes.
M31_SPEC = TinySpec(dtype="float32", seed=1)
M3_SPEC = TinySpec(dtype="float32", seed=2, num_layers=5, full_attention_layers=2, dense_layers=2)
QUANT_SPEC = TinySpec(dtype="bfloat16", seed=3, quant="modelopt-mixed")
BF16_SPEC = TinySpec(dtype="bfloat16", seed=4)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
LAYER1 = "language_model.model.layers.1."
K_PROJ = LAYER1 + "self_attn.k_proj.weight"
EXPERT0 = LAYER1 + "block_sparse_moe.experts.0."

MakeCheckpoint = Callable[[TinySpec], Path]


@pytest.fixture
def writable(tiny_checkpoint: MakeCheckpoint, tmp_path: Path) -> Callable[[TinySpec], Path]:
    """A private copy of a shared tiny checkpoint that a test may damage."""

    def copy(spec: TinySpec) -> Path:
        out = tmp_path / "ckpt"
        shutil.copytree(tiny_checkpoint(spec), out)
        return out

    return copy


def load(path: Path, dtype: str = "float32"):
    return load_model(path, CPU_REFERENCE, dtype, progress=False)


def load_error(path: Path, kind: type[Exception] = CheckpointError) -> str:
    """Load `path`, which must fail with exactly one `kind` error; return its message."""
    with pytest.raises(kind) as info:
        load(path)
    assert type(info.value) is kind
    return str(info.value)


def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite a single-file checkpoint's tensors in place through `edit`."""
    tensors = load_file(path / SINGLE)
    edit(tensors)
    save_file(tensors, path / SINGLE)


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def shard_names(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("model-*-of-*.safetensors"))


# ------------------------------------------------------------------ damaged checkpoints


def test_truncated_shard_is_named(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(dataclasses.replace(M31_SPEC, shards=3))
    shards = shard_names(path)
    assert len(shards) == 3
    victim = path / shards[1]
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    message = load_error(path)
    assert shards[1] in message
    assert "truncated" in message
    assert shards[0] not in message and shards[2] not in message


def test_shard_listed_in_index_but_deleted_is_named(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(dataclasses.replace(M31_SPEC, shards=3))
    shards = shard_names(path)
    (path / shards[2]).unlink()
    message = load_error(path)
    assert shards[2] in message
    assert "missing" in message
    assert INDEX in message


def test_index_entry_pointing_at_the_wrong_shard_names_tensor_and_shard(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(dataclasses.replace(M31_SPEC, shards=3))
    index = json.loads((path / INDEX).read_text())
    right = index["weight_map"][K_PROJ]
    wrong = next(s for s in shard_names(path) if s != right)
    index["weight_map"][K_PROJ] = wrong
    (path / INDEX).write_text(json.dumps(index))
    message = load_error(path)
    assert K_PROJ in message
    assert wrong in message


def test_wrong_shaped_tensor_names_tensor_and_both_shapes(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(M31_SPEC)

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        assert tuple(tensors[K_PROJ].shape) == (32, 64)
        tensors[K_PROJ] = tensors[K_PROJ][:, :48].contiguous()

    rewrite(path, shrink)
    message = load_error(path)
    assert f"tensor {K_PROJ} has shape [32, 48], expected [32, 64]" in message


def test_missing_tensor_is_named(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(M31_SPEC)
    rewrite(path, lambda tensors: tensors.pop(K_PROJ))
    message = load_error(path)
    assert f"1 missing tensor(s): {K_PROJ}" in message


def test_unexpected_extra_tensor_is_named(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(M31_SPEC)
    extra = LAYER1 + "self_attn.g_proj.weight"
    rewrite(path, lambda tensors: tensors.update({extra: torch.zeros(4, 64)}))
    message = load_error(path)
    assert f"1 unexpected tensor(s): {extra}" in message


def test_all_problems_of_one_checkpoint_are_reported_in_one_error(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(M31_SPEC)
    extra = "language_model.model.layers.9.input_layernorm.weight"
    v_proj = LAYER1 + "self_attn.v_proj.weight"

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        tensors.pop(K_PROJ)
        tensors[extra] = torch.zeros(64)
        tensors[v_proj] = tensors[v_proj].T.contiguous()

    rewrite(path, damage)
    message = load_error(path)
    assert K_PROJ in message and "missing" in message
    assert extra in message and "unexpected" in message
    assert f"tensor {v_proj} has shape [64, 32], expected [32, 64]" in message


def test_many_missing_tensors_are_counted_and_the_list_is_capped(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(M31_SPEC)
    layer3 = "language_model.model.layers.3."

    def drop_layer(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith(layer3)]:
            del tensors[name]

    names = [n for n in load_file(path / SINGLE) if n.startswith(layer3)]
    rewrite(path, drop_layer)
    message = load_error(path)
    assert f"{len(names)} missing tensor(s)" in message
    assert f"and {len(names) - 8} more" in message


@pytest.mark.parametrize(
    ("tensor", "stored_as", "expected"),
    [
        (EXPERT0 + "w1.weight_scale", torch.float32, "F8_E4M3"),
        (EXPERT0 + "w2.weight", torch.int8, "U8"),
        (EXPERT0 + "w3.weight_scale_2", torch.bfloat16, "F32"),
        (LAYER1 + "self_attn.q_proj.weight", torch.bfloat16, "F8_E4M3"),
        (LAYER1 + "self_attn.q_proj.weight_scale_inv", torch.int8, "U8"),
    ],
)
def test_quantized_tensor_with_wrong_dtype_is_named(
    writable: Callable[[TinySpec], Path], tensor: str, stored_as: torch.dtype, expected: str
) -> None:
    path = writable(QUANT_SPEC)

    def recast(tensors: dict[str, torch.Tensor]) -> None:
        tensors[tensor] = tensors[tensor].float().to(stored_as)

    rewrite(path, recast)
    message = load_error(path)
    assert f"tensor {tensor} has dtype" in message
    assert f"expected {expected}" in message


def test_unknown_top_level_quant_algo_names_it_and_the_supported_list(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(QUANT_SPEC)
    edit_config(path, lambda c: c["quantization_config"].update(quant_algo="FP4_AWQ"))
    message = load_error(path, ConfigError)
    assert "'FP4_AWQ'" in message
    assert "MIXED_PRECISION, MXFP8, NVFP4" in message


def test_unknown_per_layer_quant_algo_names_module_algo_and_supported_list(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(QUANT_SPEC)
    module = EXPERT0 + "w2"

    def edit(config: dict) -> None:
        layers = config["quantization_config"]["quantized_layers"]
        assert module in layers
        layers[module] = {"quant_algo": "W4A8_AWQ", "group_size": 128}

    edit_config(path, edit)
    message = load_error(path, ConfigError)
    assert module in message
    assert "'W4A8_AWQ'" in message
    assert "MXFP8, NVFP4" in message


def test_quantized_module_missing_from_quantized_layers_is_rejected_not_read_as_codes(
    writable: Callable[[TinySpec], Path],
) -> None:
    path = writable(QUANT_SPEC)
    module = LAYER1 + "self_attn.o_proj"
    edit_config(path, lambda c: c["quantization_config"]["quantized_layers"].pop(module))
    message = load_error(path)
    assert f"tensor {module}.weight has dtype F8_E4M3" in message
    assert f"unexpected tensor(s): {module}.weight_scale_inv" in message


def test_router_stored_quantized_is_rejected_naming_its_tensors(
    writable: Callable[[TinySpec], Path],
) -> None:
    """The router is never quantized (model-m3.md C.3); a checkpoint that stores it in MXFP8,
    even with the config listing it, is refused rather than loaded as garbage."""
    path = writable(QUANT_SPEC)
    router = LAYER1 + "block_sparse_moe.gate"

    def quantize_router(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{router}.weight"] = tensors[f"{router}.weight"].float().to(torch.float8_e4m3fn)
        tensors[f"{router}.weight_scale_inv"] = torch.full((8, 2), 127, dtype=torch.uint8)

    rewrite(path, quantize_router)
    edit_config(
        path,
        lambda c: c["quantization_config"]["quantized_layers"].update(
            {router: {"quant_algo": "MXFP8"}}
        ),
    )
    message = load_error(path)
    assert f"{router} is listed as MXFP8 but is not a projection" in message


def test_norm_listed_as_quantized_is_rejected(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(QUANT_SPEC)
    norm = LAYER1 + "input_layernorm"
    edit_config(
        path,
        lambda c: c["quantization_config"]["quantized_layers"].update(
            {norm: {"quant_algo": "MXFP8"}}
        ),
    )
    assert f"{norm} is listed as MXFP8 but is not a projection" in load_error(path)


def test_directory_without_safetensors_is_reported(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(M31_SPEC)
    (path / SINGLE).unlink()
    assert not list(path.glob("*.safetensors*"))
    message = load_error(path)
    assert SINGLE in message and INDEX in message
    assert str(path) in message


# ------------------------------------------------------------------- good checkpoints


def test_vision_and_projector_tensors_are_loaded_into_the_vision_tower(
    tiny_checkpoint: MakeCheckpoint,
) -> None:
    path = tiny_checkpoint(M31_SPEC)
    tensors = load_file(path / SINGLE)
    vision = [n for n in tensors if not n.startswith("language_model.")]
    assert any(n.startswith("vision_tower.") for n in vision)
    assert any(n.startswith("multi_modal_projector.") for n in vision)
    assert any(n.startswith("patch_merge_mlp.") for n in vision)
    encoder = load(path).model.vision
    assert encoder is not None
    merge = tensors["patch_merge_mlp.linear_1.weight"]
    assert torch.equal(encoder.projector.merge_linear_1.weight, merge.float())
    patch = tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"]
    assert torch.equal(encoder.patch_embedding, patch.float())


def test_a_model_built_without_the_vision_tower_skips_its_tensors_with_a_log_line(
    tiny_checkpoint: MakeCheckpoint, caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_checkpoint(M31_SPEC)
    with safe_open(str(path / SINGLE), framework="pt") as f:
        names = list(f.keys())
    vision = [n for n in names if not n.startswith("language_model.")]
    cfg = load_model_config(path)
    model = M3ForCausalLM(cfg.text, CPU_REFERENCE)
    caplog.set_level(logging.INFO, logger="m3serve.model.loader")
    load_weights(model, path, cfg, progress=False)
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())
    lines = [r.getMessage() for r in caplog.records if r.name == "m3serve.model.loader"]
    assert any(f"skipping {len(vision)} vision-tower/projector" in line for line in lines), lines


def test_mtp_tensors_are_accepted_and_skipped(writable: Callable[[TinySpec], Path]) -> None:
    path = writable(M31_SPEC)
    mtp = "language_model.model.mtp.layers.0.input_layernorm.weight"
    rewrite(path, lambda tensors: tensors.update({mtp: torch.ones(64)}))
    loaded = load(path)
    assert not any("mtp" in n for n, _ in loaded.model.named_parameters())


def test_nvfp4_input_scales_are_optional_and_do_not_change_the_weights(
    tiny_checkpoint: MakeCheckpoint, writable: Callable[[TinySpec], Path]
) -> None:
    path = writable(QUANT_SPEC)

    def drop_input_scales(tensors: dict[str, torch.Tensor]) -> None:
        names = [n for n in tensors if n.endswith(".input_scale")]
        assert names
        for name in names:
            del tensors[name]

    rewrite(path, drop_input_scales)
    without = dict(load(path).model.named_parameters())
    with_scales = dict(load(tiny_checkpoint(QUANT_SPEC)).model.named_parameters())
    assert all(torch.equal(without[n], with_scales[n]) for n in with_scales)


@pytest.mark.parametrize("spec", [M31_SPEC, QUANT_SPEC], ids=["bf16-free", "modelopt-mixed"])
def test_sharded_and_single_file_checkpoints_load_identical_parameters(
    tiny_checkpoint: MakeCheckpoint, spec: TinySpec
) -> None:
    single_dir = tiny_checkpoint(spec)
    sharded_dir = tiny_checkpoint(dataclasses.replace(spec, shards=3))
    assert len(shard_names(sharded_dir)) == 3 and (sharded_dir / INDEX).is_file()
    assert not (sharded_dir / SINGLE).exists()
    single = dict(load(single_dir).model.named_parameters())
    sharded = dict(load(sharded_dir).model.named_parameters())
    assert single.keys() == sharded.keys()
    differing = [n for n in single if not torch.equal(single[n], sharded[n])]
    assert not differing


def test_text_only_export_without_language_model_prefix_loads_the_same_parameters(
    tiny_checkpoint: MakeCheckpoint, tmp_path: Path
) -> None:
    source = tiny_checkpoint(M31_SPEC)
    shutil.copytree(source, tmp_path / "text")
    tensors = load_file(source / SINGLE)
    text = {
        n.removeprefix("language_model."): t
        for n, t in tensors.items()
        if n.startswith("language_model.")
    }
    save_file(text, tmp_path / "text" / SINGLE)
    expected = dict(load(source).model.named_parameters())
    got = dict(load(tmp_path / "text").model.named_parameters())
    # Without vision tensors the model is text-only: the same text parameters, no vision ones.
    assert set(got) == {n for n in expected if not n.startswith("vision.")}
    assert all(torch.equal(expected[n], got[n]) for n in got)


def test_bf16_checkpoint_loaded_as_float32_equals_the_stored_values_exactly(
    tiny_checkpoint: MakeCheckpoint,
) -> None:
    path = tiny_checkpoint(BF16_SPEC)
    stored = load_file(path / SINGLE)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16, torch.float32}
    fp32 = dict(load(path, "float32").model.named_parameters())
    bf16 = dict(load(path, "bfloat16").model.named_parameters())
    checked = 0
    rows = {name: t.shape[0] for name, t in stored.items() if t.dim() == 2}
    for name, value in stored.items():
        where = destination(name, rows)
        if where is None:
            continue
        param, expert, half = where
        got = param_block(fp32[param], expert, half)
        assert got.dtype == torch.float32
        assert torch.equal(got, value.float()), name
        # The same checkpoint loaded as bf16 keeps the bits (fp32-only params excepted).
        native = param_block(bf16[param], expert, half)
        assert torch.equal(native.float(), value.float()), name
        checked += 1
    assert checked == sum(1 for n in stored if n.startswith("language_model."))


@pytest.mark.parametrize("spec", [M31_SPEC, M3_SPEC, QUANT_SPEC], ids=["m3.1", "m3", "quant"])
def test_loading_leaves_no_parameter_uninitialized(
    tiny_checkpoint: MakeCheckpoint, spec: TinySpec
) -> None:
    path = tiny_checkpoint(spec)
    cfg = load_model_config(path)
    model = M3ForCausalLM(cfg.text, CPU_REFERENCE)
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.fill_(float("nan"))
    load_weights(model, path, cfg, progress=False)
    still_nan = [n for n, p in params.items() if bool(torch.isnan(p).any())]
    assert not still_nan
