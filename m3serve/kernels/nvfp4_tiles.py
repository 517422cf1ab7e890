"""The row-tiled layout of NVFP4 expert weights that the W4A16 MoE kernels read.

In the checkpoint, codes [..., R, K/2] and scales [..., R, K/16] are row-major: one K step of a
tile of rows reads a short piece of every row (64 bytes at 128 K elements), each a row apart.
On the H200 a read of that pattern drew 58 % of the read bandwidth where the same bytes in
contiguous runs of 2-4 KB drew 95 % (`perf/probe_weight_reads.py`).

Tiled: rows in groups of TILE_ROWS; within a group, K cut into tiles of TILE_K elements (128, or
the largest power of two below it that divides K), the group's rows of one tile stored together:
codes [..., R/32, K/TK, 32, TK/2] (2 KB a tile), scales [..., R/32, K/TK, 32, TK/16] (256 B a
tile). It is a permutation within each 32-row group, so a group starts where it started: byte c
of row r sits at (r // 32) * 32 * C + (c // T) * 32 * T + (r % 32) * T + c % T, with C the
bytes of a row and T those of a tile row. Expert slices (expert or tensor parallelism) are cut
from the checkpoint's rows before tiling.
"""

from __future__ import annotations

from torch import Tensor

from m3serve.kernels.quant import NVFP4_GROUP

TILE_ROWS = 32
MAX_TILE_K = 128
# K elements per column of the codes (E2M1, two a byte); the scales' is NVFP4_GROUP.
CODES_PER_BYTE = 2


def tile_k(k: int) -> int:
    """Elements of K per tile: MAX_TILE_K, or the largest power of two below it dividing k."""
    tk = MAX_TILE_K
    while k % tk:
        tk //= 2
    return tk


def tiled_shape(rows: int, k: int, elements_per_col: int) -> tuple[int, int, int, int]:
    """The tiled shape of a [rows, K / elements_per_col] tensor (without leading dims)."""
    tk = tile_k(k)
    return (rows // TILE_ROWS, k // tk, TILE_ROWS, tk // elements_per_col)


def tile_rows(t: Tensor, elements_per_col: int) -> Tensor:
    """[..., R, C] (row-major, a column holding `elements_per_col` K elements) -> a new
    contiguous [..., R/32, K/TK, 32, TK/elements_per_col]."""
    *lead, rows, cols = t.shape
    if rows % TILE_ROWS or cols * elements_per_col % NVFP4_GROUP:
        raise ValueError(f"rows ({rows}) must be a multiple of {TILE_ROWS}, K of {NVFP4_GROUP}")
    groups, tiles, _, per_tile = tiled_shape(rows, cols * elements_per_col, elements_per_col)
    grouped = t.reshape(*lead, groups, TILE_ROWS, tiles, per_tile)
    return grouped.transpose(-3, -2).contiguous()


def tile_experts(
    w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row-tiled copies of a layer's NVFP4 expert codes and scales, given in the checkpoint's
    layout ([E, 2I, H/2], [E, 2I, H/16], [E, H, I/2], [E, H, I/16])."""
    return (
        tile_rows(w13, CODES_PER_BYTE),
        tile_rows(w13_scale, NVFP4_GROUP),
        tile_rows(w2, CODES_PER_BYTE),
        tile_rows(w2_scale, NVFP4_GROUP),
    )


def untile_rows(t: Tensor) -> Tensor:
    """The inverse of `tile_rows`: [..., R/32, K/TK, 32, T] -> [..., R, C] (a new tensor)."""
    *lead, groups, tiles, rows, per_tile = t.shape
    return t.transpose(-3, -2).reshape(*lead, groups * rows, tiles * per_tile)


def tile_rows_(t: Tensor, elements_per_col: int) -> Tensor:
    """`tile_rows` of each t[i] of a contiguous [N, R, C] in place (one [R, C] of scratch at a
    time); returns the tiled view [N, R/32, K/TK, 32, T] of the same storage."""
    if not t.is_contiguous():
        raise ValueError("tiling in place needs a contiguous tensor")
    for i in range(t.shape[0]):
        t[i].copy_(tile_rows(t[i], elements_per_col).view(t.shape[1:]))
    n, rows, cols = t.shape
    return t.view(n, *tiled_shape(rows, cols * elements_per_col, elements_per_col))
