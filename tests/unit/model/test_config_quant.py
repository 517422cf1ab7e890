"""quantization_config parsing (m3serve.model.config): algorithms per module, exclude patterns and
the refusals naming what is supported.
"""

from __future__ import annotations

import pytest

from m3serve.model.config import (
    SUPPORTED_LAYER_ALGOS,
    SUPPORTED_QUANT_ALGOS,
    ConfigError,
    QuantConfig,
    parse_model_config,
    parse_quant_config,
)

from .config_raws import mixed_quant, real_m31_flash

# ----------------------------------------------------------------------- quantization


def test_mixed_precision_quantization_config_maps_modules_to_algos() -> None:
    quant = parse_quant_config(mixed_quant())
    assert isinstance(quant, QuantConfig)
    assert (quant.method, quant.algo, quant.kv_cache_algo) == ("modelopt", "MIXED_PRECISION", None)
    prefix = "language_model.model.layers.3"
    assert quant.algo_for(f"{prefix}.self_attn.q_proj") == "MXFP8"
    assert quant.algo_for(f"{prefix}.block_sparse_moe.experts.0.w1") == "NVFP4"
    assert quant.algo_for(f"{prefix}.block_sparse_moe.experts.0.w2") == "NVFP4"  # plain string
    # Absent from quantized_layers -> unquantized (router, lm_head, norms, vision).
    assert quant.algo_for(f"{prefix}.block_sparse_moe.gate") is None
    assert quant.algo_for("lm_head") is None


def test_model_config_carries_parsed_quantization() -> None:
    raw = real_m31_flash()
    raw["quantization_config"] = mixed_quant()
    model = parse_model_config(raw)
    assert model.quant == parse_quant_config(mixed_quant())


def test_single_algo_quantization_respects_exclude_patterns() -> None:
    quant = parse_quant_config(
        {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "exclude_modules": ["lm_head", "*block_sparse_moe.gate"],
        }
    )
    assert quant is not None
    assert quant.algo_for("lm_head") is None
    assert quant.algo_for("language_model.lm_head") is None
    assert quant.algo_for("language_model.model.layers.7.block_sparse_moe.gate") is None
    assert quant.algo_for("language_model.model.layers.7.block_sparse_moe.experts.1.w3") == "NVFP4"


def test_ignore_is_an_alias_of_exclude_modules() -> None:
    quant = parse_quant_config({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["x"]})
    assert quant is not None and quant.exclude == ("x",)
    assert quant.algo_for("model.x") is None and quant.algo_for("model.q_proj") == "MXFP8"


def test_exclude_patterns_match_dotted_suffixes_not_substrings() -> None:
    quant = parse_quant_config(
        {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["*.gate"]}
    )
    assert quant is not None
    assert quant.algo_for("model.layers.3.block_sparse_moe.gate") is None
    assert quant.algo_for("model.layers.0.mlp.gate_proj") == "MXFP8"


def test_missing_or_empty_quantization_config_is_none() -> None:
    assert parse_quant_config(None) is None
    assert parse_quant_config({}) is None


def test_unsupported_quant_algo_lists_supported_values() -> None:
    with pytest.raises(ConfigError) as info:
        parse_quant_config({"quant_method": "modelopt", "quant_algo": "FP8"})
    message = str(info.value)
    assert "quant_algo" in message and "'FP8'" in message
    assert all(algo in message for algo in SUPPORTED_QUANT_ALGOS)


def test_unsupported_quant_method_names_it() -> None:
    with pytest.raises(ConfigError) as info:
        parse_quant_config({"quant_method": "gptq", "quant_algo": "NVFP4"})
    assert "quant_method" in str(info.value) and "modelopt" in str(info.value)


def test_unsupported_per_layer_algo_names_module_and_supported_values() -> None:
    raw = mixed_quant()
    raw["quantized_layers"]["language_model.model.layers.5.mlp.down_proj"] = {"quant_algo": "W4A8"}
    with pytest.raises(ConfigError) as info:
        parse_quant_config(raw)
    message = str(info.value)
    assert "layers.5.mlp.down_proj" in message and "W4A8" in message
    assert all(algo in message for algo in SUPPORTED_LAYER_ALGOS)


def test_mixed_precision_without_quantized_layers_is_rejected() -> None:
    with pytest.raises(ConfigError, match="quantized_layers"):
        parse_quant_config({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"})
