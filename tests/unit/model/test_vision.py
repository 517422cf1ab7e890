"""The vision tower on its own: patch order and 3-D RoPE against transformers, segment
isolation, input checks, and loading it from the checkpoint (or running without it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import M31_SPEC
from helpers.devices import CPU_REFERENCE
from helpers.vision import random_pixels
from safetensors.torch import load_file, save_file

from m3serve.model.build import load_model
from m3serve.model.loader import CheckpointFiles
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TINY_VISION
from m3serve.model.vision.config import VisionConfig, parse_vision_config
from m3serve.model.vision.inventory import PARAM_PREFIX, vision_inventory
from m3serve.model.vision.rope import axial_cos_sin, patch_positions

GRIDS = [(1, 2, 2), (1, 4, 6), (2, 6, 4), (3, 2, 8)]


@pytest.mark.parametrize("grid", GRIDS)
def test_patch_positions_are_merge_window_major_as_in_transformers(grid) -> None:
    from transformers.vision_utils import get_vision_position_ids

    expected = get_vision_position_ids(torch.tensor([grid]), 2, include_temporal=True)
    assert torch.equal(patch_positions(grid, 2), expected)


def test_the_first_four_patches_are_the_first_2x2_window() -> None:
    positions = patch_positions((1, 4, 6), 2)
    assert positions[:4].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert positions[4].tolist() == [0, 0, 2]  # then the window to its right


@pytest.mark.parametrize(
    "raw", [TINY_VISION, {}], ids=["tiny (2 freqs per axis)", "real (13 freqs per axis)"]
)
def test_axial_rope_matches_transformers(raw: dict) -> None:
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLVisionConfig,
    )
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLVisionRotaryEmbedding,
    )
    from transformers.vision_utils import get_vision_position_ids

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    hf = MiniMaxM3VLVisionRotaryEmbedding(MiniMaxM3VLVisionConfig(**fields))
    cfg = parse_vision_config(raw, 64, 64)
    positions = get_vision_position_ids(torch.tensor(GRIDS), 2, include_temporal=True)
    cos, sin = hf(torch.zeros(1), positions)  # [patches, 3], as the tower passes it
    ours_cos, ours_sin = axial_cos_sin(GRIDS, cfg, torch.device("cpu"))
    assert ours_cos.shape[-1] == 6 * cfg.rope_freqs < cfg.head_dim
    torch.testing.assert_close(ours_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin, rtol=0, atol=1e-6)


def test_real_vision_config_defaults() -> None:
    cfg = parse_vision_config({}, 6144, None)
    assert (cfg.patch_dim, cfg.head_dim, cfg.rope_freqs) == (1176, 80, 13)
    assert cfg == VisionConfig()


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable) -> M3ForCausalLM:
    return load_model(tiny_checkpoint(M31_SPEC), CPU_REFERENCE, "float32", progress=False).model


def _pixels(seed: int, grid) -> torch.Tensor:
    return torch.from_numpy(random_pixels(seed, grid))


def test_an_images_features_do_not_depend_on_the_other_images_encoded_with_it(model) -> None:
    encoder = model.vision
    assert encoder is not None
    a, b, c = (1, 4, 6), (1, 2, 2), (2, 4, 4)
    alone = encoder.encode(_pixels(1, a), [a])
    together = encoder.encode(torch.cat([_pixels(2, b), _pixels(1, a), _pixels(3, c)]), [b, a, c])
    rows_b, rows_a = encoder.num_tokens([b]), encoder.num_tokens([a])
    assert together.shape[0] == encoder.num_tokens([b, a, c]) == 1 + 6 + 8
    torch.testing.assert_close(together[rows_b : rows_b + rows_a], alone, rtol=0, atol=1e-6)


def test_encode_refuses_pixels_that_do_not_match_the_grids(model) -> None:
    assert model.vision is not None
    with pytest.raises(ValueError, match="do not match grids"):
        model.vision.encode(_pixels(1, (1, 4, 6)), [(1, 4, 4)])


def test_every_vision_tensor_of_the_checkpoint_is_loaded(tiny_checkpoint: Callable, model) -> None:
    names = set(CheckpointFiles(tiny_checkpoint(M31_SPEC)).location)
    assert model.vision is not None
    specs = vision_inventory(model.vision.cfg)
    stored = {n for n in names if not n.startswith("language_model.")}
    assert {s.name for s in specs} == stored
    params = {PARAM_PREFIX + n for n, _ in model.vision.named_parameters()}
    assert {s.param for s in specs} == params


def test_a_checkpoint_without_vision_tensors_loads_as_text_only(
    tiny_checkpoint: Callable, tmp_path: Path
) -> None:
    source = tiny_checkpoint(M31_SPEC)
    for item in source.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    text = {n: t for n, t in tensors.items() if n.startswith("language_model.")}
    save_file(text, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path, CPU_REFERENCE, "float32", progress=False)
    assert loaded.model.vision is None
    assert loaded.config.vision is not None  # the config still describes one
