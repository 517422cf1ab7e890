"""VisionEncoder: the ViT tower and the patch-merge projector, from patch vectors to one text
embedding per LLM placeholder token.

Tower (CLIP-like, pre-LN, biases everywhere): patch embed (the Conv3d with kernel = stride =
one patch is a matmul over the 1176-vector), `pre_layrnorm`, then per layer
`x += out_proj(attn(LN1(x)))`, `x += fc2(gelu(fc1(LN2(x))))`, no final norm. Attention is
bidirectional within a segment (one image, or one video chunk) and never across segments, so
batching images from several requests changes nothing. Projector: per patch
`linear_2(gelu(linear_1(.)))` to the text width, then each run of 4 patches (one 2x2 window,
thanks to the patch order) concatenated and `merge_linear_2(gelu(merge_linear_1(.)))`.

Attribute names mirror the checkpoint (`model/vision/inventory.py` maps them); matmuls go through
the backend's `linear`, attention through torch SDPA per segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.model.backend import Backend
from m3serve.model.params import weight
from m3serve.model.vision.config import VisionConfig
from m3serve.model.vision.rope import Grid, axial_cos_sin, rope_tables, rotate


class Affine(nn.Module):
    """y = x W^T + b."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = weight(d_out, d_in, dtype=dtype, device=device)
        self.bias = weight(d_out, dtype=dtype, device=device)

    def run(self, backend: Backend, x: torch.Tensor) -> torch.Tensor:
        return backend.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = weight(dim, dtype=dtype, device=device)
        self.bias = weight(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj = Affine(h, h, dtype, device)
        self.k_proj = Affine(h, h, dtype, device)
        self.v_proj = Affine(h, h, dtype, device)
        self.out_proj = Affine(h, h, dtype, device)

    def attend(
        self,
        backend: Backend,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: list[int],
    ) -> torch.Tensor:
        n = x.shape[0]
        shape = (n, self.heads, self.head_dim)
        q = rotate(self.q_proj.run(backend, x).view(shape), cos, sin)
        k = rotate(self.k_proj.run(backend, x).view(shape), cos, sin)
        v = self.v_proj.run(backend, x).view(shape)
        outs = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            # [1, heads, n, head_dim]: each segment attends only to itself.
            qh, kh, vh = (t.transpose(0, 1)[None] for t in (qs, ks, vs))
            out = F.scaled_dot_product_attention(qh, kh, vh, scale=self.head_dim**-0.5)
            outs.append(out[0].transpose(0, 1).reshape(qs.shape[0], -1))
        return self.out_proj.run(backend, outs[0] if len(outs) == 1 else torch.cat(outs))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.fc1 = Affine(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.fc2 = Affine(cfg.intermediate_size, cfg.hidden_size, dtype, device)

    def run(self, backend: Backend, x: torch.Tensor) -> torch.Tensor:
        return self.fc2.run(backend, F.gelu(self.fc1.run(backend, x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        eps = cfg.layer_norm_eps
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps, dtype, device)
        self.self_attn = VisionAttention(cfg, dtype, device)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = VisionMLP(cfg, dtype, device)

    def run(
        self,
        backend: Backend,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: list[int],
    ) -> torch.Tensor:
        x = x + self.self_attn.attend(backend, self.layer_norm1(x), cos, sin, lengths)
        return x + self.mlp.run(backend, self.layer_norm2(x))


class Projector(nn.Module):
    """Per patch to the text width, then each 2x2 window of patches to one token."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        mid, text = cfg.projector_hidden_size, cfg.text_hidden_size
        self.merge = cfg.merge
        self.linear_1 = Affine(cfg.hidden_size, mid, dtype, device)
        self.linear_2 = Affine(mid, text, dtype, device)
        self.merge_linear_1 = Affine(text * cfg.merge, mid, dtype, device)
        self.merge_linear_2 = Affine(mid, text, dtype, device)

    def run(self, backend: Backend, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2.run(backend, F.gelu(self.linear_1.run(backend, x)))
        x = x.reshape(x.shape[0] // self.merge, -1)
        return self.merge_linear_2.run(backend, F.gelu(self.merge_linear_1.run(backend, x)))


class VisionEncoder(nn.Module):
    def __init__(
        self,
        cfg: VisionConfig,
        backend: Backend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.dtype = dtype
        c, t, p = cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size
        # Stored as the checkpoint's Conv3d kernel; used flattened, as a matmul per patch.
        self.patch_embedding = weight(cfg.hidden_size, c, t, p, p, dtype=dtype, device=device)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(VisionLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.projector = Projector(cfg, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.device

    def num_tokens(self, grids: list[Grid]) -> int:
        """LLM tokens the segments of `grids` turn into."""
        return sum(t * h * w for t, h, w in grids) // self.cfg.merge

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels [patches, patch_dim] of the segments `grids` (t, h, w), back to back ->
        [sum(t * h/2 * w/2), text_hidden] in the model dtype."""
        lengths = [t * h * w for t, h, w in grids]
        if pixels.ndim != 2 or pixels.shape != (sum(lengths), self.cfg.patch_dim):
            raise ValueError(
                f"pixels {list(pixels.shape)} do not match grids {grids}: expected "
                f"[{sum(lengths)}, {self.cfg.patch_dim}]"
            )
        backend = self.backend
        x = pixels.to(self.device, self.dtype)
        x = backend.linear(x, self.patch_embedding.reshape(self.cfg.hidden_size, -1))
        x = self.pre_layrnorm(x)
        # Once per call, in the model's dtype and the [patches, 1, rot] shape every layer uses.
        cos, sin = rope_tables(*axial_cos_sin(grids, self.cfg, self.device), self.dtype)
        for layer in self.layers:
            x = layer.run(backend, x, cos, sin, lengths)
        return self.projector.run(backend, x)
