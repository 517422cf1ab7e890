"""Parsing the DSpark draft's `config.json` (the checkpoint's `dspark/` subfolder) into a
frozen `DSparkConfig`.

The draft's layers are dense M3 decoder layers, so their geometry is parsed by the target's
own `parse_text_config` (after marking every layer dense and full-attention); the DSpark keys
(`dspark_*`, `sliding_window`) sit beside it. Both a nested `text_config` and a flat config are
read. Quantization: ModelOpt's `quantization_config` as for the target, or the released draft's
global `{"quant_method": "mxfp8", "weight_block_size": [1, 32]}` (every decoder-layer
projection MXFP8, `fc` and the Markov tables BF16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3serve.model.config import (
    ConfigError,
    QuantConfig,
    TextConfig,
    parse_quant_config,
    parse_text_config,
)

DSPARK_DIR = "dspark"
DSPARK_ARCHITECTURE = "DSparkMiniMaxDraftModel"


@dataclass(frozen=True)
class DSparkConfig:
    layers: TextConfig  # geometry of the dense draft layers (vocab = the target's)
    target_layer_ids: tuple[int, ...] = (3, 17, 31, 45, 59)
    block_size: int = 7
    noise_token_id: int = 200058
    markov_rank: int = 256
    # Keys a query at position q sees: [q - (sliding_window - 1), q] (SGLang's window_left).
    sliding_window: int = 4096
    confidence_head: bool = True
    quant: QuantConfig | None = None

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target residual streams that `fc` reads."""
        return len(self.target_layer_ids) * self.layers.hidden_size


def load_dspark_config(draft_dir: str | Path) -> DSparkConfig:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in the DSpark draft directory {draft_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return parse_dspark_config(raw)


def parse_dspark_config(raw: dict[str, Any]) -> DSparkConfig:
    arch = (raw.get("architectures") or [DSPARK_ARCHITECTURE])[0]
    if arch != DSPARK_ARCHITECTURE:
        raise ConfigError(f"draft architectures[0]={arch!r}, expected {DSPARK_ARCHITECTURE!r}")
    text = dict(raw.get("text_config") or raw)
    if text.get("sparse_attention_config") or any(text.get("moe_layer_freq") or []):
        raise ConfigError("the DSpark draft must be dense: no sparse attention, no MoE")
    if text.get("dspark_markov_head_type", "vanilla") != "vanilla":
        raise ConfigError(
            f"dspark_markov_head_type={text['dspark_markov_head_type']!r} is not supported"
        )
    n = int(text.get("num_hidden_layers", 5))
    heads = int(text.get("num_attention_heads", 64))
    # The draft has no indexer: index geometry is set to values that always validate.
    layers = parse_text_config(
        {
            **{k: v for k, v in text.items() if k not in ("layer_types", "mlp_layer_types")},
            "num_hidden_layers": n,
            "sparse_attention_config": {"use_sparse_attention": False},
            "moe_layer_freq": [0] * n,
            "index_n_heads": heads,
            "index_head_dim": int(text.get("head_dim") or 128),
            "dense_intermediate_size": int(
                text.get("dspark_ffn_hidden_size", text.get("dense_intermediate_size", 12288))
            ),
        }
    )
    cfg = DSparkConfig(
        layers=layers,
        target_layer_ids=tuple(
            int(i) for i in text.get("dspark_target_layer_ids", (3, 17, 31, 45, 59))
        ),
        block_size=int(text.get("dspark_block_size", 7)),
        noise_token_id=int(text.get("dspark_noise_token_id", 200058)),
        markov_rank=int(text.get("dspark_markov_rank", 256)),
        sliding_window=int(text.get("sliding_window") or 4096),
        confidence_head=bool(text.get("enable_confidence_head", False)),
        quant=_parse_draft_quant(raw.get("quantization_config")),
    )
    _validate(cfg)
    return cfg


def _parse_draft_quant(raw: dict[str, Any] | None) -> QuantConfig | None:
    if raw and raw.get("quant_method") == "mxfp8":
        if raw.get("weight_block_size", [1, 32]) != [1, 32]:
            raise ConfigError(f"draft MXFP8 weight_block_size {raw['weight_block_size']}")
        # `fc` is a projection too, but ships in BF16.
        return QuantConfig(method="mxfp8", algo="MXFP8", exclude=("fc",))
    return parse_quant_config(raw)


def check_against_target(cfg: DSparkConfig, target: TextConfig) -> None:
    """The draft reads the target's residual streams, embedding and LM head: the shapes and
    layer ids must fit the target."""
    d = cfg.layers
    problems = [
        f"{key} {a} != target {b}"
        for key, a, b in (
            ("hidden_size", d.hidden_size, target.hidden_size),
            ("vocab_size", d.vocab_size, target.vocab_size),
        )
        if a != b
    ]
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"dspark_target_layer_ids {bad} outside the target's layers")
    if not 0 <= cfg.noise_token_id < target.vocab_size:
        problems.append(f"dspark_noise_token_id {cfg.noise_token_id} outside the vocabulary")
    if problems:
        raise ConfigError("DSpark draft does not fit its target: " + "; ".join(problems))


def _validate(cfg: DSparkConfig) -> None:
    if cfg.block_size < 1 or cfg.markov_rank < 1 or cfg.sliding_window < 1:
        raise ConfigError("dspark_block_size, dspark_markov_rank, sliding_window must be >= 1")
    if not cfg.target_layer_ids:
        raise ConfigError("dspark_target_layer_ids is empty")
