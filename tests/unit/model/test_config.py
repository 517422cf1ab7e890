"""config.json parsing (m3serve.model.config): every spelling lands in the same TextConfig.

The quantization_config part: test_config_quant.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from m3serve.model.config import (
    ConfigError,
    TextConfig,
    load_model_config,
    parse_model_config,
    parse_text_config,
)

from .config_raws import legacy_with, real_m31_flash, sparse_with, tiny_flat_text, tiny_legacy_text

# ------------------------------------------------------------------------- equal spellings


def test_legacy_and_hf_flat_spellings_parse_to_equal_text_configs() -> None:
    legacy = parse_text_config(tiny_legacy_text())
    flat = parse_text_config(tiny_flat_text())
    assert legacy == flat
    assert legacy.layer_types == ("sparse", "full", "sparse", "sparse")
    assert legacy.mlp_layer_types == ("dense", "moe", "moe", "moe")
    assert (legacy.rotary_dim, legacy.rope_theta) == (8, 5e6)
    assert (legacy.index_n_heads, legacy.index_head_dim) == (2, 16)
    assert (legacy.index_block_size, legacy.index_topk_blocks, legacy.index_local_blocks) == (
        4,
        3,
        1,
    )


def test_composite_config_parses_its_text_config() -> None:
    raw = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": tiny_legacy_text(),
        "vision_config": {"hidden_size": 32},
        "image_token_index": 250,
        "video_token_id": 251,
        "dtype": "float32",
    }
    model = parse_model_config(raw)
    assert model.text == parse_text_config(tiny_flat_text())
    assert model.vision == {"hidden_size": 32}
    assert (model.image_token_id, model.video_token_id) == (250, 251)
    assert model.torch_dtype == "float32"
    assert model.quant is None


def test_flat_text_only_config_has_no_vision() -> None:
    model = parse_model_config(tiny_flat_text())
    assert model.vision is None
    assert model.architecture == "MiniMaxM3SparseForConditionalGeneration"


def test_vision_config_without_text_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="text_config"):
        parse_model_config({"vision_config": {}, "hidden_size": 64, "num_attention_heads": 4})


def test_real_m31_flash_config_parses_to_the_defaults() -> None:
    model = parse_model_config(real_m31_flash())
    assert model.text == TextConfig()
    assert model.text.layer_types == ("sparse",) * 60
    assert model.text.mlp_layer_types == ("dense",) * 3 + ("moe",) * 57
    assert model.text.page_size == 128
    assert (model.text.q_size, model.text.kv_size) == (8192, 512)
    assert model.image_token_id == 200025
    assert model.architecture == "MiniMaxM3SparseForConditionalGeneration"


def test_legacy_block_wins_over_flat_index_keys() -> None:
    raw = legacy_with(index_topk_blocks=2, index_block_size=8)
    cfg = parse_text_config(raw)
    assert (cfg.index_topk_blocks, cfg.index_block_size) == (3, 4)


def test_flat_layer_types_win_over_sparse_attention_freq() -> None:
    raw = legacy_with(layer_types=["full_attention"] * 4)
    assert parse_text_config(raw).layer_types == ("full",) * 4


def test_missing_sparse_config_means_full_attention_and_all_moe() -> None:
    raw = tiny_flat_text()
    del raw["layer_types"], raw["mlp_layer_types"]
    cfg = parse_text_config(raw)
    assert cfg.layer_types == ("full",) * 4
    assert cfg.mlp_layer_types == ("moe",) * 4


def test_sparse_init_block_maps_to_index_init_blocks() -> None:
    assert parse_text_config(sparse_with(sparse_init_block=1)).index_init_blocks == 1


def test_eos_list_becomes_tuple() -> None:
    assert parse_text_config(legacy_with(eos_token_id=[2, 3])).eos_token_ids == (2, 3)
    assert parse_text_config(legacy_with(eos_token_id=2)).eos_token_ids == (2,)


# ------------------------------------------------------------------------------- rotary dim


def test_rotary_dim_alone_is_used() -> None:
    raw = legacy_with(rotary_dim=4)
    del raw["partial_rotary_factor"]
    assert parse_text_config(raw).rotary_dim == 4


def test_partial_rotary_factor_alone_sets_rotary_dim() -> None:
    raw = legacy_with(partial_rotary_factor=0.25)
    del raw["rotary_dim"]
    assert parse_text_config(raw).rotary_dim == 4


def test_neither_rotary_key_rotates_half_the_head() -> None:
    raw = tiny_legacy_text()
    del raw["rotary_dim"], raw["partial_rotary_factor"]
    assert parse_text_config(raw).rotary_dim == 8


def test_rotary_dim_disagreeing_with_partial_rotary_factor_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        parse_text_config(legacy_with(rotary_dim=16, partial_rotary_factor=0.5))
    assert "rotary_dim" in str(info.value) and "partial_rotary_factor" in str(info.value)


def test_rotary_dim_disagreeing_with_rope_parameters_factor_is_rejected() -> None:
    raw = tiny_flat_text()
    raw["rotary_dim"] = 4
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        parse_text_config(raw)


# --------------------------------------------------------------------- unsupported values


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (legacy_with(scoring_func="softmax"), "scoring_func"),
        (legacy_with(use_routing_bias=False), "use_routing_bias"),
        (legacy_with(hidden_act="gelu"), "hidden_act"),
        (legacy_with(attention_output_gate=True), "attention_output_gate"),
        (legacy_with(qk_norm_type="per_layer"), "qk_norm_type"),
        (legacy_with(tie_word_embeddings=True), "tie_word_embeddings"),
        (legacy_with(n_shared_experts=2), "n_shared_experts"),
        (legacy_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (legacy_with(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (sparse_with(sparse_score_type="mean"), "sparse_score_type"),
        (sparse_with(sparse_disable_index_value=[1, 0, 1, 1]), "sparse_disable_index_value"),
        (legacy_with(moe_layer_freq=[0, 1, 1]), "moe_layer_freq"),
        (legacy_with(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
        (legacy_with(layer_types=["minimax_m3_sparse"] * 5), "layer_types"),
        (legacy_with(layer_types=["sliding_attention"] * 4), "layer_types"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_value_raises_config_error_naming_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_text_config(raw)
    assert key in str(info.value)


def test_wrong_length_sparse_attention_freq_error_names_the_key() -> None:
    # The message must name the key the user has to fix, as it does for moe_layer_freq.
    with pytest.raises(ConfigError) as info:
        parse_text_config(sparse_with(sparse_attention_freq=[1, 1, 1]))
    assert "sparse_attention_freq" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_key_value_heads": 3}, "kv heads"),
        ({"sparse_topk_blocks": 1, "sparse_local_block": 2}, "index_topk_blocks"),
        ({"sparse_local_block": 0}, "index_local_blocks"),
        ({"sparse_num_index_heads": 3}, "index heads"),
    ],
)
def test_inconsistent_shapes_are_rejected(changes: dict, fragment: str) -> None:
    raw = tiny_legacy_text()
    for key, value in changes.items():
        target = raw["sparse_attention_config"] if key.startswith("sparse_") else raw
        target[key] = value
    with pytest.raises(ConfigError, match=fragment):
        parse_text_config(raw)


def test_text_config_is_frozen() -> None:
    cfg = TextConfig()
    with pytest.raises(AttributeError):
        cfg.num_layers = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------- loading


def test_load_model_config_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(real_m31_flash()))
    assert load_model_config(tmp_path).text == TextConfig()


def test_load_model_config_on_missing_dir_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model_config(tmp_path / "absent")


def test_load_model_config_on_invalid_json_raises_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"text_config": {')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)


# ------------------------------------------------------------------------- HF agreement


@pytest.mark.parametrize("variant", ["tiny", "m3_leading_full_layers", "real_m31"])
def test_hf_config_interprets_raw_keys_like_we_do(variant: str) -> None:
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

    if variant == "real_m31":
        raw = real_m31_flash()
    else:
        text = tiny_legacy_text()
        if variant == "m3_leading_full_layers":
            text["sparse_attention_config"]["sparse_attention_freq"] = [0, 0, 1, 1]
            text["moe_layer_freq"] = [0, 0, 1, 1]
        raw = {"model_type": "minimax_m3_vl", "text_config": text, "vision_config": {}}
    ours = parse_model_config(copy.deepcopy(raw)).text
    hf = MiniMaxM3VLConfig(**copy.deepcopy(raw)).text_config

    attn = {"minimax_m3_sparse": "sparse", "full_attention": "full"}
    mlp = {"sparse": "moe", "dense": "dense"}
    assert tuple(attn[t] for t in hf.layer_types) == ours.layer_types
    assert tuple(mlp[t] for t in hf.mlp_layer_types) == ours.mlp_layer_types
    assert (
        hf.index_n_heads,
        hf.index_head_dim,
        hf.index_block_size,
        hf.index_topk_blocks,
        hf.index_local_blocks,
    ) == (
        ours.index_n_heads,
        ours.index_head_dim,
        ours.index_block_size,
        ours.index_topk_blocks,
        ours.index_local_blocks,
    )
    hf_rot = int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert (hf_rot, hf.rope_parameters["rope_theta"]) == (ours.rotary_dim, ours.rope_theta)
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (
        ours.num_experts,
        ours.num_experts_per_tok,
    )
