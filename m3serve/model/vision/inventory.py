"""The vision tower's and projector's checkpoint tensors: names as the released checkpoint
stores them, shapes, and the `VisionEncoder` parameter each lands in (under the text model's
`vision.` attribute). The loader checks and reads them like the text weights; `make-tiny` writes
exactly these names."""

from __future__ import annotations

from m3serve.model.inventory import Kind, TensorSpec
from m3serve.model.vision.config import VisionConfig

TOWER = "vision_tower.vision_model."
# Where the encoder sits in M3ForCausalLM.
PARAM_PREFIX = "vision."


def vision_inventory(cfg: VisionConfig) -> list[TensorSpec]:
    """Every vision tensor, in a fixed order (replicated on every rank: it is small)."""
    h, c, t, p = cfg.hidden_size, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size
    specs = [
        _spec(TOWER + "embeddings.patch_embedding.weight", (h, c, t, p, p), "patch_embedding"),
        *_affine_norm(TOWER + "pre_layrnorm", "pre_layrnorm", h, "norm"),
    ]
    for layer in range(cfg.num_layers):
        specs.extend(_layer(cfg, layer))
    mid, text = cfg.projector_hidden_size, cfg.text_hidden_size
    for stored, param, rows, cols in (
        ("multi_modal_projector.linear_1", "projector.linear_1", mid, h),
        ("multi_modal_projector.linear_2", "projector.linear_2", text, mid),
        ("patch_merge_mlp.linear_1", "projector.merge_linear_1", mid, text * cfg.merge),
        ("patch_merge_mlp.linear_2", "projector.merge_linear_2", text, mid),
    ):
        specs.extend(_affine(stored, param, rows, cols))
    return specs


def _layer(cfg: VisionConfig, layer: int) -> list[TensorSpec]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    stored, param = f"{TOWER}encoder.layers.{layer}.", f"layers.{layer}."
    specs: list[TensorSpec] = []
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        specs.extend(_affine(stored + "self_attn." + proj, param + "self_attn." + proj, h, h))
    for norm in ("layer_norm1", "layer_norm2"):
        specs.extend(_affine_norm(stored + norm, param + norm, h, "norm"))
    specs.extend(_affine(stored + "mlp.fc1", param + "mlp.fc1", i, h))
    specs.extend(_affine(stored + "mlp.fc2", param + "mlp.fc2", h, i))
    return specs


def _affine(stored: str, param: str, rows: int, cols: int) -> list[TensorSpec]:
    return [
        _spec(f"{stored}.weight", (rows, cols), f"{param}.weight", "linear"),
        _spec(f"{stored}.bias", (rows,), f"{param}.bias", "bias"),
    ]


def _affine_norm(stored: str, param: str, dim: int, kind: Kind) -> list[TensorSpec]:
    return [
        _spec(f"{stored}.weight", (dim,), f"{param}.weight", kind),
        _spec(f"{stored}.bias", (dim,), f"{param}.bias", "bias"),
    ]


def _spec(name: str, shape: tuple[int, ...], param: str, kind: Kind = "table") -> TensorSpec:
    """`kind` "table" for the patch embedding: a 5-D kernel, never a quantized projection."""
    return TensorSpec(name, shape, PARAM_PREFIX + param, (), kind)
