"""From a checkpoint directory (or the built-in tiny one) to a ready `M3ForCausalLM` on a
backend: the device and the compute dtype it runs in, the weights loaded."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from m3serve.model.backend import Backend
from m3serve.model.config import ModelConfig, load_model_config
from m3serve.model.loader import has_vision_weights, load_weights
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.parallel import SINGLE, Parallel
from m3serve.model.vision.config import vision_config
from m3serve.model.weights import WeightFormats

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: M3ForCausalLM
    config: ModelConfig
    path: Path
    backend: Backend
    dtype: torch.dtype
    device: torch.device


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        # CPU matmuls in bf16 are slow and inexact; fp32 is both faster and the reference.
        return torch.float32
    if cfg.quant is not None:
        return torch.bfloat16
    return DTYPES.get(cfg.torch_dtype, torch.bfloat16)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers, each storage counted once (views share one)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())
    }
    return sum(storages.values())


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the target model's safetensors files (the draft's, in its own folder, apart)."""
    return sum(f.stat().st_size for f in path.glob("model*.safetensors"))


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def load_model(
    model_path: str | Path | None,
    backend: Backend,
    dtype: str = "auto",
    progress: bool | logging.Logger = True,
    parallel: Parallel = SINGLE,
    vision: bool = True,
) -> LoadedModel:
    """The model at `model_path` (None: the built-in tiny checkpoint) on `backend`'s device;
    `progress` as `load_weights` takes it; `parallel`: this rank's share of a TP group;
    `vision` False: without the vision tower even if the checkpoint has one (the follower
    ranks of a TP engine, which take rank 0's image features)."""
    if model_path is None:
        from m3serve.model.tiny.default import default_model_path

        model_path = default_model_path()
    path = Path(model_path)
    config = load_model_config(path)
    device = backend.device
    torch_dtype = resolve_dtype(dtype, config, device)
    started = time.monotonic()
    formats = WeightFormats(config.quant, backend.weight_formats)
    # The vision tower is built when the checkpoint has one; text-only exports run without it.
    tower = vision_config(config) if vision and has_vision_weights(path) else None
    model = M3ForCausalLM(config.text, backend, torch_dtype, device, formats, parallel, tower)
    load_weights(model, path, config, progress=progress, parallel=parallel)
    backend.prepare_weights(model)
    model.eval()
    seconds = time.monotonic() - started
    stored = checkpoint_bytes(path)
    log.info(
        "loaded %s (%s, %s, backend %s) in %.1fs: weights %s on the device, checkpoint %s "
        "(%.2f GB/s)",
        path,
        str(torch_dtype).removeprefix("torch."),
        device,
        backend.name,
        seconds,
        _size(weight_bytes(model)),
        _size(stored),
        stored / 1e9 / max(seconds, 1e-9),
    )
    return LoadedModel(model, config, path, backend, torch_dtype, device)
