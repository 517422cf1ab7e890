"""Writing a tiny random DSpark draft into a tiny checkpoint's `dspark/` subfolder, in the
released draft's layout: its own config.json (`DSparkMiniMaxDraftModel`, nested text_config)
and tensor names from `draft_inventory`, so the loader reads it exactly as the real one.
With `quant="modelopt-mixed"` the decoder-layer projections are MXFP8 (listed in a ModelOpt
MIXED_PRECISION block); `fc`, norms and the Markov/confidence heads stay unquantized.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from m3serve.kernels import quant
from m3serve.model.dspark_config import DSPARK_ARCHITECTURE, DSPARK_DIR, parse_dspark_config
from m3serve.model.dspark_loader import draft_inventory
from m3serve.model.tiny.tokenizer import special_token_ids

if TYPE_CHECKING:
    from m3serve.model.tiny.checkpoint import TinySpec

TINY_MARKOV_RANK = 16
TINY_TARGETS = 3


def target_layer_ids(num_layers: int, count: int = TINY_TARGETS) -> list[int]:
    """Evenly spread target layers ending at the last one, as the real [3, 17, 31, 45, 59]."""
    count = min(count, num_layers)
    if count == 1:
        return [num_layers - 1]
    return sorted({round(j * (num_layers - 1) / (count - 1)) for j in range(count)})


def draft_config(spec: TinySpec) -> dict[str, Any]:
    text = {
        k: v
        for k, v in spec.text_config().items()
        if k not in ("sparse_attention_config", "moe_layer_freq")
    }
    text.update(
        num_hidden_layers=spec.dspark_layers,
        dense_intermediate_size=spec.dense_intermediate_size,
        dspark_ffn_hidden_size=spec.dense_intermediate_size,
        layer_types=["sliding_attention"] * spec.dspark_layers,
        moe_layer_freq=[0] * spec.dspark_layers,
        sliding_window=spec.dspark_window,
        dspark_target_layer_ids=target_layer_ids(spec.num_layers),
        dspark_block_size=7,
        dspark_noise_token_id=special_token_ids(spec.vocab_size)["]<]minimax[>["],
        dspark_markov_rank=TINY_MARKOV_RANK,
        dspark_markov_head_type="vanilla",
        dspark_use_dense_ffn=True,
        enable_confidence_head=True,
    )
    return {
        "architectures": [DSPARK_ARCHITECTURE],
        "model_type": "dspark_minimax",
        "text_config": text,
        "torch_dtype": spec.dtype,
    }


def write_tiny_dspark(out: Path, spec: TinySpec) -> Path:
    """Write `out/dspark/` for the tiny target described by `spec`."""
    raw = draft_config(spec)
    cfg = parse_dspark_config(raw)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, str]] = {}
    for s in draft_inventory(cfg):
        if s.kind in ("norm", "bias"):
            value = torch.randn(s.shape, generator=generator) * 0.1
        else:
            # Markov tables large enough that the correction changes argmaxes in tests.
            std = 1.0 if "markov" in s.name else 1.0 / math.sqrt(s.shape[-1])
            value = torch.randn(s.shape, generator=generator) * std
        if spec.quant == "modelopt-mixed" and s.kind == "linear" and ".decoder_layer." in s.name:
            codes, scales = quant.quant_mxfp8(value)
            tensors[f"{s.module}.weight"] = codes
            tensors[f"{s.module}.weight_scale_inv"] = scales
            layers[s.module] = {"quant_algo": "MXFP8"}
        else:
            tensors[s.name] = value.to(dtype)
    if layers:
        raw["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "producer": {"name": "m3serve-make-tiny", "version": "1"},
            "quantized_layers": layers,
        }
    draft_dir = out / DSPARK_DIR
    draft_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in sorted(tensors.items())}, draft_dir / "model.safetensors"
    )
    (draft_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return draft_dir
