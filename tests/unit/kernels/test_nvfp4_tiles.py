"""The row-tiled layout of NVFP4 experts (m3serve.kernels.nvfp4_tiles): where each byte goes, the
way back, and tiling in place."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.kernels.nvfp4_tiles import (
    CODES_PER_BYTE,
    TILE_ROWS,
    tile_k,
    tile_rows,
    tile_rows_,
    tiled_shape,
    untile_rows,
)
from m3serve.kernels.quant import NVFP4_GROUP

# K widths (multiples of 32, as the kernels require) with one, several and partial tiles.
K_WIDTHS = st.sampled_from([32, 64, 96, 128, 160, 384, 512])


def test_tile_k_is_the_largest_power_of_two_up_to_128_dividing_k() -> None:
    assert [tile_k(k) for k in (32, 64, 96, 128, 160, 6144, 3072)] == [
        32,
        64,
        32,
        128,
        32,
        128,
        128,
    ]


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 3),
    k=K_WIDTHS,
    per_col=st.sampled_from([CODES_PER_BYTE, NVFP4_GROUP]),
    data=st.data(),
)
def test_each_byte_lands_where_the_layout_says(groups: int, k: int, per_col: int, data) -> None:
    rows, cols = groups * TILE_ROWS, k // per_col
    t = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)
    flat = tile_rows(t, per_col).flatten()
    tile_cols = tile_k(k) // per_col  # columns of one tile row
    r = data.draw(st.integers(0, rows - 1))
    c = data.draw(st.integers(0, cols - 1))
    at = (
        (r // TILE_ROWS) * TILE_ROWS * cols
        + (c // tile_cols) * TILE_ROWS * tile_cols
        + (r % TILE_ROWS) * tile_cols
        + c % tile_cols
    )
    assert int(flat[at]) == int(t[r, c])


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(1, 3), groups=st.integers(1, 2), k=K_WIDTHS)
def test_untiling_gives_the_rows_back_and_in_place_tiling_agrees(
    experts: int, groups: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(k * 7 + groups)
    codes = torch.randint(0, 256, (experts, groups * TILE_ROWS, k // 2), generator=gen)
    codes = codes.to(torch.uint8)
    tiled = tile_rows(codes, CODES_PER_BYTE)
    assert tiled.shape == (experts, *tiled_shape(groups * TILE_ROWS, k, CODES_PER_BYTE))
    assert torch.equal(untile_rows(tiled), codes)
    in_place = codes.clone()
    view = tile_rows_(in_place, CODES_PER_BYTE)
    assert view.data_ptr() == in_place.data_ptr() and torch.equal(view, tiled)
