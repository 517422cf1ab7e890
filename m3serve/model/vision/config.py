"""The vision tower's config (`vision_config` of the composite config.json) plus the projector
widths it needs from the top level and the text config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3serve.model.config import ConfigError, ModelConfig

# The real checkpoint's projector width (`projector_hidden_size`), HF's default.
DEFAULT_PROJECTOR_HIDDEN = 6144


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    text_hidden_size: int = 6144  # what the projector outputs: one text embedding per token
    projector_hidden_size: int = DEFAULT_PROJECTOR_HIDDEN

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch vector: channels x frames x patch x patch (1176 for the real model)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge(self) -> int:
        """Patches per LLM token (one 2x2 window)."""
        return self.spatial_merge_size**2

    @property
    def rope_freqs(self) -> int:
        """Rotary frequencies per axis (t, h, w): 13 for head_dim 80."""
        return (self.head_dim // 3) // 2


def parse_vision_config(
    raw: dict[str, Any], text_hidden_size: int, projector_hidden_size: int | None
) -> VisionConfig:
    """From config.json's `vision_config` (HF names), refusing what would change the math."""
    act = raw.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(f"vision_config.hidden_act {act!r} is not supported (only exact gelu)")
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "axial")
    if rope_type != "axial":
        raise ConfigError(f"vision rope_type {rope_type!r} is not supported (only axial)")
    cfg = VisionConfig(
        hidden_size=int(raw.get("hidden_size", 1280)),
        intermediate_size=int(raw.get("intermediate_size", 5120)),
        num_layers=int(raw.get("num_hidden_layers", 32)),
        num_heads=int(raw.get("num_attention_heads", 16)),
        num_channels=int(raw.get("num_channels", 3)),
        patch_size=int(raw.get("patch_size", 14)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        text_hidden_size=text_hidden_size,
        projector_hidden_size=projector_hidden_size or DEFAULT_PROJECTOR_HIDDEN,
    )
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError("vision hidden_size must be a multiple of num_attention_heads")
    return cfg


def vision_config(model: ModelConfig) -> VisionConfig | None:
    """The checkpoint's vision config, or None for a text-only config."""
    if model.vision is None:
        return None
    return parse_vision_config(model.vision, model.text.hidden_size, model.projector_hidden_size)
