"""Which format the model holds each weight in (m3serve.model.weights.WeightFormats)."""

from __future__ import annotations

from m3serve.model.config import QuantConfig
from m3serve.model.weights import WeightFormats

BOTH = frozenset({"MXFP8", "NVFP4"})
LAYER = "model.layers.3.self_attn."


def mixed(**layers: str) -> QuantConfig:
    names = {f"language_model.{LAYER}{name}": algo for name, algo in layers.items()}
    return QuantConfig("modelopt", "MIXED_PRECISION", names)


def test_a_weight_is_dense_without_a_quant_config_or_a_backend_that_reads_its_format() -> None:
    quant = mixed(q_proj="MXFP8")
    assert WeightFormats().of([LAYER + "q_proj"]) == "dense"
    assert WeightFormats(quant, frozenset()).of([LAYER + "q_proj"]) == "dense"
    assert WeightFormats(quant, frozenset({"NVFP4"})).of([LAYER + "q_proj"]) == "dense"
    assert WeightFormats(quant, BOTH).of([LAYER + "q_proj"]) == "MXFP8"


def test_a_fused_weight_keeps_a_format_only_when_every_member_has_it() -> None:
    quant = mixed(q_proj="MXFP8", k_proj="MXFP8", v_proj="MXFP8")
    formats = WeightFormats(quant, BOTH)
    assert formats.of([LAYER + n for n in ("q_proj", "k_proj", "v_proj")]) == "MXFP8"
    # o_proj is not in the quant config: a fusion with it would be mixed, so dense.
    assert formats.of([LAYER + "q_proj", LAYER + "o_proj"]) == "dense"


def test_text_only_exports_are_matched_without_the_checkpoint_prefix() -> None:
    quant = QuantConfig("modelopt", "MIXED_PRECISION", {LAYER + "q_proj": "MXFP8"})
    assert WeightFormats(quant, BOTH).of([LAYER + "q_proj"]) == "MXFP8"
