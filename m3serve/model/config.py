"""Parsing a MiniMax-M3 / M3.1 `config.json` into one frozen, validated `ModelConfig` (and its
`generation_config.json` into a `GenerationConfig`): the only place either file is read.

Three spellings exist in the wild and all land in the same `TextConfig`:
- the composite `minimax_m3_vl` config with a `text_config` block (the real checkpoint),
- the legacy raw keys inside it (`sparse_attention_config`, `moe_layer_freq`, flat `rope_theta`),
- HF's flat form (`layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

AttnKind = Literal["sparse", "full"]
FfnKind = Literal["moe", "dense"]


class ConfigError(ValueError):
    """A config.json this build cannot serve; the message names the offending key."""


@dataclass(frozen=True)
class TextConfig:
    """The language backbone. Defaults are the real M3.1-Flash values."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_layers: int = 60
    num_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1_048_576
    intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288
    num_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    layer_types: tuple[AttnKind, ...] = ("sparse",) * 60
    mlp_layer_types: tuple[FfnKind, ...] = ("dense",) * 3 + ("moe",) * 57
    bos_token_id: int | None = 200034
    eos_token_ids: tuple[int, ...] = (200020,)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _validate_text(self)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def page_size(self) -> int:
        # One sparse block is one KV page, so block selection maps straight onto page tables.
        return self.index_block_size

    def is_sparse(self, layer: int) -> bool:
        return self.layer_types[layer] == "sparse"

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "moe"


@dataclass(frozen=True)
class QuantConfig:
    """ModelOpt quantization: which checkpoint module is stored in which format."""

    method: str
    algo: str
    # Checkpoint module name ("language_model.model.layers.3.self_attn.q_proj") -> "MXFP8"|"NVFP4".
    layers: dict[str, str] = field(default_factory=dict)
    # With a single global algo: module-name patterns kept in high precision.
    exclude: tuple[str, ...] = ()
    kv_cache_algo: str | None = None

    def algo_for(self, module: str) -> str | None:
        """The format a checkpoint module is stored in, or None if it is unquantized."""
        if self.algo == "MIXED_PRECISION":
            return self.layers.get(module)
        if any(_glob_match(pattern, module) for pattern in self.exclude):
            return None
        return self.algo


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    architecture: str = "MiniMaxM3SparseForConditionalGeneration"
    torch_dtype: str = "bfloat16"
    quant: QuantConfig | None = None
    vision: dict[str, Any] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    projector_hidden_size: int | None = None


SUPPORTED_QUANT_ALGOS = ("MIXED_PRECISION", "MXFP8", "NVFP4")
SUPPORTED_LAYER_ALGOS = ("MXFP8", "NVFP4")

# Keys that change the math; anything other than these values is a different model.
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),
    "qk_norm_type": ("per_head",),
    "use_qk_norm": (True,),
    "use_gemma_norm": (True,),
    "attention_output_gate": (False,),
    "hidden_act": ("swigluoai", "silu"),
    "swiglu_beta": (1.0, 1),
    "tie_word_embeddings": (False,),
}


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: extra end-of-sequence ids and the recommended sampling."""

    eos_token_ids: tuple[int, ...] = ()
    # The checkpoint's sampling defaults, e.g. {"temperature": 1.0, "top_p": 0.95}.
    sampling: dict[str, float] = field(default_factory=dict)


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")


def load_generation_config(model_dir: str | Path) -> GenerationConfig:
    """The checkpoint's generation_config.json; an empty one where the file is absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    raw = _read_json(path)
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    sampling = {k: raw[k] for k in SAMPLING_DEFAULT_KEYS if k in raw}
    return GenerationConfig(tuple(int(i) for i in ids), sampling)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    return parse_model_config(_read_json(path))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from any of the supported config.json spellings."""
    composite = "text_config" in raw
    text_raw = dict(raw["text_config"]) if composite else dict(raw)
    if not composite and "text_config" not in raw and "vision_config" in raw:
        raise ConfigError("config.json has vision_config but no text_config")
    text = parse_text_config(text_raw)
    architectures = raw.get("architectures") or ["MiniMaxM3SparseForConditionalGeneration"]
    return ModelConfig(
        text=text,
        architecture=str(architectures[0]),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        quant=parse_quant_config(raw.get("quantization_config")),
        vision=raw.get("vision_config") if composite else None,
        image_token_id=raw.get("image_token_index", raw.get("image_token_id")),
        video_token_id=raw.get("video_token_index", raw.get("video_token_id")),
        projector_hidden_size=raw.get("projector_hidden_size") if composite else None,
    )


def parse_text_config(raw: dict[str, Any]) -> TextConfig:
    for key, allowed in _REQUIRED_VALUES.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(
                f"text_config.{key}={raw[key]!r} is not supported (expected {allowed})"
            )
    sparse = raw.get("sparse_attention_config") or {}
    _check_sparse_extras(sparse)
    num_layers = int(raw.get("num_hidden_layers", 60))
    # HF's default when the key is absent (not hidden / heads, which would be 96 for M3).
    head_dim = int(raw.get("head_dim") or 128)
    theta, rotary_dim = _rope(raw, head_dim)
    intermediate = int(raw.get("intermediate_size", TextConfig.intermediate_size))
    n_shared = int(raw.get("n_shared_experts", 1))
    if n_shared != 1:
        raise ConfigError(f"text_config.n_shared_experts={n_shared} is not supported (expected 1)")
    eos = raw.get("eos_token_id", 200020)
    return TextConfig(
        vocab_size=int(raw.get("vocab_size", 200064)),
        hidden_size=int(raw.get("hidden_size", 6144)),
        num_layers=num_layers,
        num_heads=int(raw.get("num_attention_heads", 64)),
        num_kv_heads=int(raw.get("num_key_value_heads", 4)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1_048_576)),
        intermediate_size=intermediate,
        shared_intermediate_size=int(raw.get("shared_intermediate_size", intermediate * n_shared)),
        dense_intermediate_size=int(raw.get("dense_intermediate_size", 12288)),
        num_experts=int(raw.get("num_local_experts", raw.get("num_experts", 128))),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 4)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        index_n_heads=int(_pick(raw, sparse, "index_n_heads", "sparse_num_index_heads", 4)),
        index_head_dim=int(_pick(raw, sparse, "index_head_dim", "sparse_index_dim", 128)),
        index_block_size=int(_pick(raw, sparse, "index_block_size", "sparse_block_size", 128)),
        index_topk_blocks=int(_pick(raw, sparse, "index_topk_blocks", "sparse_topk_blocks", 16)),
        index_local_blocks=int(_pick(raw, sparse, "index_local_blocks", "sparse_local_block", 1)),
        index_init_blocks=int(sparse.get("sparse_init_block", raw.get("index_init_blocks", 0))),
        layer_types=_layer_types(raw, sparse, num_layers),
        mlp_layer_types=_mlp_layer_types(raw, num_layers),
        bos_token_id=raw.get("bos_token_id", 200034),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        pad_token_id=raw.get("pad_token_id"),
    )


def parse_quant_config(raw: dict[str, Any] | None) -> QuantConfig | None:
    if not raw:
        return None
    method = str(raw.get("quant_method", ""))
    if method != "modelopt":
        raise ConfigError(
            f"quantization_config.quant_method={method!r} is not supported (expected 'modelopt')"
        )
    algo = str(raw.get("quant_algo", ""))
    if algo not in SUPPORTED_QUANT_ALGOS:
        raise ConfigError(
            f"quantization_config.quant_algo={algo!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_QUANT_ALGOS)})"
        )
    layers: dict[str, str] = {}
    for module, spec in (raw.get("quantized_layers") or {}).items():
        layer_algo = str(spec.get("quant_algo", "")) if isinstance(spec, dict) else str(spec)
        if layer_algo not in SUPPORTED_LAYER_ALGOS:
            raise ConfigError(
                f"quantization_config.quantized_layers[{module!r}].quant_algo={layer_algo!r} "
                f"is not supported (supported: {', '.join(SUPPORTED_LAYER_ALGOS)})"
            )
        layers[module] = layer_algo
    if algo == "MIXED_PRECISION" and not layers:
        raise ConfigError("quantization_config: MIXED_PRECISION without quantized_layers")
    exclude = tuple(raw.get("exclude_modules") or raw.get("ignore") or ())
    return QuantConfig(
        method=method,
        algo=algo,
        layers=layers,
        exclude=exclude,
        kv_cache_algo=raw.get("kv_cache_quant_algo"),
    )


def _pick(raw: dict[str, Any], sparse: dict[str, Any], flat: str, legacy: str, default: int) -> Any:
    # The legacy nested block wins, as in HF's own parsing of the raw checkpoint config.
    return sparse.get(legacy, raw.get(flat, default))


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """RoPE theta and the number of rotated channels per head.

    HF derives the rotary width only from `partial_rotary_factor`; the raw checkpoint also carries
    `rotary_dim`. When both are present they must agree; when neither is, M3 rotates half the head.
    """
    params = raw.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={params['rope_type']!r} is not supported")
    if raw.get("rope_scaling"):
        raise ConfigError("text_config.rope_scaling is not supported (M3 uses plain RoPE)")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 5_000_000.0)))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    from_factor = None if factor is None else int(head_dim * float(factor))
    from_dim = raw.get("rotary_dim")
    if from_dim is not None and from_factor is not None and int(from_dim) != from_factor:
        raise ConfigError(
            f"text_config.rotary_dim={from_dim} disagrees with partial_rotary_factor={factor} "
            f"(head_dim {head_dim} x factor = {from_factor})"
        )
    rotary_dim = int(from_dim) if from_dim is not None else from_factor or head_dim // 2
    return theta, rotary_dim


def _layer_types(raw: dict[str, Any], sparse: dict[str, Any], n: int) -> tuple[AttnKind, ...]:
    if raw.get("layer_types") is not None:
        names = {"minimax_m3_sparse": "sparse", "full_attention": "full"}
        return _named_kinds(raw["layer_types"], names, n, "layer_types")
    if "sparse_attention_freq" in sparse:
        freq = sparse["sparse_attention_freq"]
        kinds = tuple("sparse" if f else "full" for f in freq)
        return _exact_length(kinds, n, "sparse_attention_config.sparse_attention_freq")
    enabled = sparse.get("use_sparse_attention", bool(sparse))
    return ("sparse" if enabled else "full",) * n


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[FfnKind, ...]:
    if raw.get("mlp_layer_types") is not None:
        names = {"sparse": "moe", "dense": "dense"}
        return _named_kinds(raw["mlp_layer_types"], names, n, "mlp_layer_types")
    if raw.get("moe_layer_freq") is not None:
        freq = raw["moe_layer_freq"]
        return _exact_length(tuple("moe" if f else "dense" for f in freq), n, "moe_layer_freq")
    return ("moe",) * n


def _named_kinds(values: list[str], names: dict[str, str], n: int, key: str) -> tuple[Any, ...]:
    unknown = [v for v in values if v not in names]
    if unknown:
        raise ConfigError(f"text_config.{key} contains unknown type {unknown[0]!r}")
    return _exact_length(tuple(names[v] for v in values), n, key)


def _exact_length(kinds: tuple[Any, ...], n: int, key: str) -> tuple[Any, ...]:
    if len(kinds) != n:
        raise ConfigError(f"text_config.{key} has {len(kinds)} entries for {n} layers")
    return kinds


def _check_sparse_extras(sparse: dict[str, Any]) -> None:
    score = sparse.get("sparse_score_type", "max")
    if score != "max":
        raise ConfigError(f"sparse_attention_config.sparse_score_type={score!r} is not supported")
    disable_value = sparse.get("sparse_disable_index_value")
    if disable_value is not None and not all(disable_value):
        raise ConfigError(
            "sparse_attention_config.sparse_disable_index_value must be 1 on every layer "
            "(the index value/output branch is not supported)"
        )


def _validate_text(c: TextConfig) -> None:
    checks = [
        (c.num_heads % c.num_kv_heads == 0, "attention heads must be a multiple of kv heads"),
        (c.num_heads % c.index_n_heads == 0, "attention heads must be a multiple of index heads"),
        (0 < c.rotary_dim <= c.head_dim, "rotary_dim must be in (0, head_dim]"),
        (c.rotary_dim % 2 == 0, "rotary_dim must be even"),
        (c.index_head_dim >= c.rotary_dim, "index_head_dim must be >= rotary_dim"),
        (c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok must be <= num experts"),
        (c.index_block_size > 0, "index_block_size must be positive"),
        (c.index_local_blocks >= 1, "index_local_blocks must be >= 1"),
        (
            c.index_topk_blocks >= c.index_local_blocks + c.index_init_blocks,
            "index_topk_blocks must cover the forced local and init blocks",
        ),
        (len(c.layer_types) == c.num_layers, "layer_types length must equal num_hidden_layers"),
        (len(c.mlp_layer_types) == c.num_layers, "mlp_layer_types length must equal layers"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"text_config: {message} ({_summary(c)})")


def _summary(c: TextConfig) -> str:
    return (
        f"heads={c.num_heads}, kv_heads={c.num_kv_heads}, index_heads={c.index_n_heads}, "
        f"head_dim={c.head_dim}, rotary_dim={c.rotary_dim}, layers={c.num_layers}"
    )


def _glob_match(pattern: str, name: str) -> bool:
    # ModelOpt writes bare module names ("lm_head") as well as globs; match those as a dotted
    # suffix, never as a substring ("*.gate" must not catch "gate_proj").
    return fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}")
