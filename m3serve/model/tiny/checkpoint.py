"""Writing tiny random checkpoints in the real MiniMax-M3.1 layout.

Same config.json schema (composite `minimax_m3_vl`, raw text keys), same tensor names and, with
`quant="modelopt-mixed"`, the same ModelOpt MIXED_PRECISION formats (MXFP8 dense projections,
NVFP4 experts) as the released checkpoint — only the sizes are small. Deterministic per seed
(and device).

Tensors are drawn, quantized and written one shard at a time, so a slice at real widths (tens of
GB) never sits in host memory whole; `device="cuda"` draws and quantizes on the GPU, which makes
such a slice quick to write on the GPU machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from m3serve.kernels import quant
from m3serve.model.config import ModelConfig, parse_model_config
from m3serve.model.inventory import TensorSpec, text_inventory
from m3serve.model.tiny.dspark import write_tiny_dspark
from m3serve.model.tiny.tokenizer import special_token_ids, write_tokenizer_files
from m3serve.model.vision.config import (
    DEFAULT_PROJECTOR_HIDDEN,
    VisionConfig,
    parse_vision_config,
)
from m3serve.model.vision.inventory import vision_inventory
from m3serve.runtime.options import option

QuantMode = Literal["none", "modelopt-mixed"]


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny checkpoint. Defaults exercise every path: sparse selection drops blocks
    from position 12 on (blocks of 4, top-3), a dense first layer, MoE layers, shared expert."""

    vocab_size: int = option(512, "vocabulary size (the top 64 ids are MiniMax's special tokens)")
    hidden_size: int = option(64, "model width")
    num_layers: int = option(4, "decoder layers")
    num_heads: int = option(4, "attention heads")
    num_kv_heads: int = option(2, "KV heads (also the number of index heads)")
    head_dim: int = option(16, "attention head width")
    rotary_dim: int = option(8, "rotated channels per head")
    dense_layers: int = option(1, "leading layers with a dense MLP instead of MoE")
    full_attention_layers: int = option(0, "leading full-attention layers (M3); 0 for M3.1")
    dense_intermediate_size: int = option(96, "dense MLP width")
    intermediate_size: int = option(32, "routed and shared expert width")
    num_experts: int = option(8, "routed experts per MoE layer")
    num_experts_per_tok: int = option(2, "experts routed per token")
    index_head_dim: int = option(16, "lightning indexer head width")
    index_block_size: int = option(4, "sparse block size = KV page size")
    index_topk_blocks: int = option(3, "blocks each query attends to")
    max_position_embeddings: int = option(65536, "context length written to config.json")
    dtype: Literal["float32", "bfloat16"] = option("bfloat16", "dtype of unquantized tensors")
    quant: QuantMode = option("none", "modelopt-mixed: MXFP8 projections, NVFP4 experts")
    seed: int = option(0, "random seed; the same seed writes byte-identical files")
    shards: int = option(
        1, "safetensors shards, contiguous in layer order (>1 writes an index file)"
    )
    device: str = option(
        "cpu", "where weights are drawn and quantized (cuda: fast at real widths; other bytes)"
    )
    dspark: bool = option(False, "also write a random DSpark draft into dspark/")
    dspark_layers: int = option(2, "DSpark draft decoder layers (the real draft has 5)")
    dspark_window: int = option(16, "DSpark draft attention window (sliding_window)")
    vision: Literal["tiny", "real"] = option(
        "tiny", "vision tower: tiny, or M3.1's sizes (32 x 1280, projector 6144) for timing"
    )

    def __post_init__(self) -> None:
        if self.quant == "modelopt-mixed":
            widths = {
                "hidden_size": (self.hidden_size, quant.MXFP8_BLOCK),
                "num_heads * head_dim": (self.num_heads * self.head_dim, quant.MXFP8_BLOCK),
                "dense_intermediate_size": (self.dense_intermediate_size, quant.MXFP8_BLOCK),
                "intermediate_size": (self.intermediate_size, quant.MXFP8_BLOCK),
            }
            for name, (value, block) in widths.items():
                if value % block:
                    raise ValueError(f"modelopt-mixed needs {name} % {block} == 0, not {value}")
        if self.shards < 1:
            raise ValueError("shards must be >= 1")

    def text_config(self) -> dict[str, Any]:
        layers = range(self.num_layers)
        specials = special_token_ids(self.vocab_size)
        return {
            "model_type": "minimax_m3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "rope_theta": 5_000_000.0,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "hidden_act": "swigluoai",
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "swiglu_beta": 1.0,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "use_gemma_norm": True,
            "attention_output_gate": False,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "n_shared_experts": 1,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": 2.0,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "moe_layer_freq": [0 if i < self.dense_layers else 1 for i in layers],
            "sparse_attention_config": {
                "use_sparse_attention": True,
                "sparse_num_index_heads": self.num_kv_heads,
                "sparse_index_dim": self.index_head_dim,
                "sparse_block_size": self.index_block_size,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_local_block": 1,
                "sparse_init_block": 0,
                "sparse_score_type": "max",
                "sparse_attention_freq": [
                    0 if i < self.full_attention_layers else 1 for i in layers
                ],
                "sparse_disable_index_value": [1] * self.num_layers,
            },
            "bos_token_id": specials["]~!b["],
            "eos_token_id": specials["[e~["],
            "pad_token_id": specials["]!p~["],
            "tie_word_embeddings": False,
        }

    def config(self) -> dict[str, Any]:
        specials = special_token_ids(self.vocab_size)
        config: dict[str, Any] = {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "text_config": self.text_config(),
            "vision_config": self.vision_config(),
            "projector_hidden_size": self.projector_hidden_size(),
            "image_token_index": specials["]<]image[>["],
            "video_token_index": specials["]<]video[>["],
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "m3serve_tiny": asdict(self),
        }
        if self.quant == "modelopt-mixed":
            config["quantization_config"] = _quantization_config(self, self.text_model_config())
        return config

    def vision_config(self) -> dict[str, Any]:
        return TINY_VISION if self.vision == "tiny" else REAL_VISION

    def projector_hidden_size(self) -> int:
        return self.hidden_size if self.vision == "tiny" else DEFAULT_PROJECTOR_HIDDEN

    def text_model_config(self) -> ModelConfig:
        return parse_model_config({"text_config": self.text_config()})


TINY_VISION: dict[str, Any] = {
    "model_type": "minimax_m3_vl_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}


# M3.1's tower (model-m3.md §A.4), for timing the vision path on a slice.
REAL_VISION: dict[str, Any] = TINY_VISION | {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
}


def make_tiny(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a tiny checkpoint (config, weights, tokenizer, chat template) into out_dir."""
    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = spec.text_model_config()
    vision = parse_vision_config(
        spec.vision_config(), spec.hidden_size, spec.projector_hidden_size()
    )
    generator = torch.Generator(device=spec.device).manual_seed(spec.seed)
    total = sum(math.prod(s.shape) for s in [*text_inventory(cfg.text), *vision_inventory(vision)])
    parts = chain(_text_tensors(spec, cfg, generator), _vision_tensors(spec, vision, generator))
    _save_shards(out, parts, total, spec.shards)
    (out / "config.json").write_text(json.dumps(spec.config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(spec), indent=2))
    write_tokenizer_files(out, spec.vocab_size)
    if spec.dspark:
        write_tiny_dspark(out, spec)
    return out


# What one logical weight is stored as (name -> host tensor), after its element count; the
# stored tensors of w1 come out with its expert's w3 (the two share one global scale).
Part = tuple[int, dict[str, torch.Tensor]]


def _generation_config(spec: TinySpec) -> dict[str, Any]:
    text = spec.text_config()
    return {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 0.95,
    }


def _torch_dtype(spec: TinySpec) -> torch.dtype:
    return torch.float32 if spec.dtype == "float32" else torch.bfloat16


def _random_value(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """Scales chosen so activations stay O(1), logits are well separated (greedy ties would
    make parity flaky) and the SwiGLU-OAI clamps at +-7 really trigger."""
    shape = spec.shape
    noise = torch.randn(shape, generator=generator, device=generator.device)
    if spec.kind in ("norm", "bias"):
        return noise * 0.1
    fan_in = shape[-1]
    if spec.name.endswith("embed_tokens.weight"):
        std = 1.0
    elif spec.kind == "table" or spec.module.endswith(("gate_proj", "up_proj", ".w1", ".w3")):
        std = 3.0 / math.sqrt(fan_in)
    else:
        std = 1.0 / math.sqrt(fan_in)
    return noise * std


def _text_tensors(spec: TinySpec, cfg: ModelConfig, generator: torch.Generator) -> Iterator[Part]:
    dtype = _torch_dtype(spec)
    waiting: dict[str, torch.Tensor] = {}  # w1 values, by expert, until their w3 is drawn
    for s in text_inventory(cfg.text):
        value = _random_value(s, generator)
        numel = value.numel()
        algo = _quant_algo(spec, s)
        if algo is None:
            stored = torch.float32 if s.kind == "bias" else dtype
            yield numel, {s.name: value.to(stored).cpu()}
        elif algo == "MXFP8":
            weight, scale = quant.quant_mxfp8(value)
            yield (
                numel,
                {f"{s.module}.weight": weight.cpu(), f"{s.module}.weight_scale_inv": scale.cpu()},
            )
        elif s.module.endswith(".w1"):
            waiting[s.module.removesuffix(".w1")] = value
            yield numel, {}
        elif s.module.endswith(".w3"):
            expert = s.module.removesuffix(".w3")
            w1 = waiting.pop(expert)
            amax = max(w1.abs().max().item(), value.abs().max().item())
            shared = amax / (6.0 * 448.0)
            yield (
                numel,
                _nvfp4_tensors(f"{expert}.w1", w1, shared)
                | _nvfp4_tensors(s.module, value, shared),
            )
        else:
            yield numel, _nvfp4_tensors(s.module, value, None)


def _nvfp4_tensors(
    module: str, value: torch.Tensor, scale_2: float | None
) -> dict[str, torch.Tensor]:
    packed, scales, global_scale = quant.quant_nvfp4(value, scale_2)
    return {
        f"{module}.weight": packed.cpu(),
        f"{module}.weight_scale": scales.cpu(),
        f"{module}.weight_scale_2": global_scale.cpu(),
        f"{module}.input_scale": torch.tensor(1.0 / 448.0, dtype=torch.float32),
    }


def _quant_algo(spec: TinySpec, s: TensorSpec) -> str | None:
    if spec.quant == "none" or s.kind != "linear":
        return None
    return "NVFP4" if ".experts." in s.module else "MXFP8"


def _quantization_config(spec: TinySpec, cfg: ModelConfig) -> dict[str, Any]:
    layers = {}
    for s in text_inventory(cfg.text):
        algo = _quant_algo(spec, s)
        if algo == "MXFP8":
            layers[s.module] = {"quant_algo": "MXFP8"}
        elif algo == "NVFP4":
            layers[s.module] = {"quant_algo": "NVFP4", "group_size": quant.NVFP4_GROUP}
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "m3serve-make-tiny", "version": "1"},
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "*block_sparse_moe.gate"],
        "quantized_layers": layers,
    }


def _vision_tensors(
    spec: TinySpec, cfg: VisionConfig, generator: torch.Generator
) -> Iterator[Part]:
    """The vision tower and projector under the checkpoint's names (model/vision/inventory.py),
    scaled so activations stay O(1): features that matter to the logits make parity meaningful."""
    dtype = _torch_dtype(spec)
    for s in vision_inventory(cfg):
        noise = torch.randn(s.shape, generator=generator, device=generator.device)
        if s.kind == "norm":
            value = 1.0 + 0.1 * noise  # LayerNorm scales the input by w itself (not 1 + w)
        elif s.kind == "bias":
            value = 0.1 * noise
        else:
            fan_in = math.prod(s.shape[1:])
            value = noise / math.sqrt(fan_in)
        yield noise.numel(), {s.name: value.to(dtype).cpu()}


def _save_shards(out: Path, parts: Iterator[Part], total: int, shards: int) -> None:
    """Write the parts as `shards` files, each the parts whose first element falls in its
    1/shards of `total` (fewer files if a part spans several); one shard is in memory at once."""
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    if shards <= 1:
        tensors: dict[str, torch.Tensor] = {}
        for _, stored in parts:
            tensors.update(stored)
        save_file(_sorted(tensors), out / "model.safetensors")
        return
    written: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    done = index = size = 0

    def flush() -> None:
        nonlocal size
        if current:
            staged = out / f"model-part-{len(written)}.safetensors.tmp"
            save_file(_sorted(current), staged)
            written.append((staged, sorted(current)))
            size += sum(t.numel() * t.element_size() for t in current.values())
            current.clear()

    for numel, stored in parts:
        shard = min(done * shards // max(total, 1), shards - 1)
        if shard != index:
            flush()
            index = shard
        current.update(stored)
        done += numel
    flush()
    weight_map: dict[str, str] = {}
    for k, (staged, names) in enumerate(written):
        file = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        staged.rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index_json = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")


def _sorted(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: tensors[n].contiguous() for n in sorted(tensors)}
