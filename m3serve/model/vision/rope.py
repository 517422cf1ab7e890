"""The vision tower's 3-D axial RoPE and the patch order it assumes.

Patches arrive merge-window-major: for each spatial_merge x spatial_merge window (row-major over
windows), its patches row-major; frames (t) outermost. Each patch rotates by its (t, h, w) grid
coordinates: per axis `rope_freqs` frequencies theta^(-2j / (2 * rope_freqs)), the three axes'
angles side by side, duplicated for the rotate-half pairing; the channels past them pass through.
"""

from __future__ import annotations

import torch

from m3serve.model.vision.config import VisionConfig

Grid = tuple[int, int, int]


def patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """(t, h, w) of each patch of one segment, in the merge-window-major order: [t*h*w, 3]."""
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {grid}: h and w must be multiples of the merge size {merge}")
    rows = (
        torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    )
    cols = (
        torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    )
    # Window index (h // merge, w // merge) outermost, then the position inside the window.
    hw = torch.stack((rows, cols), dim=-1).permute(0, 2, 1, 3, 4).reshape(h * w, 2)
    frames = torch.arange(t).repeat_interleave(h * w)
    return torch.cat((frames[:, None], hw.repeat(t, 1)), dim=1)


def axial_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    width = 2 * cfg.rope_freqs
    exponents = torch.arange(0, width, 2, dtype=torch.float32) / width
    return 1.0 / (cfg.rope_theta**exponents)


def axial_cos_sin(
    grids: list[Grid], cfg: VisionConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [patches, 6 * rope_freqs] for every patch of `grids`, back to back."""
    positions = torch.cat([patch_positions(g, cfg.spatial_merge_size) for g in grids])
    inv_freq = axial_inv_freq(cfg)
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # [N, 3 * freqs], t|h|w
    angles = torch.cat((angles, angles), dim=-1).to(device)
    return angles.cos(), angles.sin()


def rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`axial_cos_sin`'s tables as `rotate` takes them: [N, 1, rot] in `dtype`, and the sine's
    first half negated, so that rotate-half becomes a roll."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :].to(dtype), signed[:, None, :].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim], rotated in place over its first cos.shape[-1] channels
    (rotate-half pairs) with `rope_tables`' cos and signed sine; returns x.

    rotate_half(x) * sin = cat(-x2, x1) * cat(s, s) = roll(x, half) * cat(-s, s): the same
    products, so the result equals `m3serve.kernels.rope.apply_rope`'s (four kernels, not ten).
    """
    rot = cos.shape[-1]
    head = x[..., :rot]
    rolled = head.roll(rot // 2, dims=-1).mul_(signed_sin)
    head.mul_(cos).add_(rolled)
    return x
