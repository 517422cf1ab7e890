"""m3serve.kernels.quant's bit-exact MXFP8/NVFP4 decoding, E2M1 packing and the E2M1 rounding
ladder, against the scalar reference decoders of quant_refs.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from m3serve.kernels.quant import (
    E2M1_MAGNITUDES,
    MXFP8_BLOCK,
    NVFP4_GROUP,
    dequant_mxfp8,
    dequant_nvfp4,
    e2m1_codes,
    e8m0_to_float,
    pack_e2m1,
    unpack_e2m1,
)

from .quant_refs import (
    DEVICES,
    E4M3_NAN_BYTES,
    FAST,
    assert_bitwise_equal,
    f32,
    random_bytes,
    ref_e2m1,
    ref_e4m3,
    ref_e8m0,
    ref_nearest_e2m1_code,
    shapes_2d,
)

# ---------------------------------------------------------------- reference decoders


def test_reference_e4m3_decoder_matches_torch_float8_for_all_256_bytes() -> None:
    # Validates the reference itself, so the decoder tests below do not just trust torch.
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert_bitwise_equal(torch_values, f32([ref_e4m3(b) for b in range(256)]))


def test_e4m3_nan_bytes_are_0x7f_and_0xff_only() -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.isnan(values).nonzero().flatten().tolist() == list(E4M3_NAN_BYTES)
    assert values[0x7E].item() == 448.0


@pytest.mark.parametrize("device", DEVICES)
def test_e8m0_to_float_decodes_all_256_bytes_exactly(device: str) -> None:
    out = e8m0_to_float(torch.arange(256, dtype=torch.uint8, device=device)).cpu()
    assert_bitwise_equal(out, f32([ref_e8m0(b) for b in range(256)]))
    assert out[0].item() == 2.0**-127  # float32 subnormal, not flushed to zero
    assert out[127].item() == 1.0


def test_e8m0_to_float_keeps_leading_dims() -> None:
    exps = torch.tensor([[[0, 127], [128, 255]]], dtype=torch.uint8)
    assert e8m0_to_float(exps).shape == (1, 2, 2)


def test_e2m1_magnitudes_constant_matches_bit_layout() -> None:
    assert tuple(ref_e2m1(c) for c in range(8)) == E2M1_MAGNITUDES


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_e2m1_decodes_all_16_codes_in_both_nibbles(device: str) -> None:
    packed = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16)
    expected = [[ref_e2m1(b & 0xF), ref_e2m1(b >> 4)] for b in range(256)]
    assert_bitwise_equal(unpack_e2m1(packed).cpu(), f32(expected).reshape(16, 32))


# ------------------------------------------------------------------------- packing


def test_nvfp4_low_nibble_holds_even_element() -> None:
    # 0x21: element 0 = code 1 (0.5), element 1 = code 2 (1.0).
    # 0xF7: element 2 = code 7 (6.0), element 3 = code 0xF (-6.0).
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]


def test_pack_e2m1_puts_even_element_in_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 7, 15]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0xF7]]


@FAST
@given(shape=shapes_2d, seed=st.integers(0, 2**31 - 1))
def test_pack_then_unpack_returns_the_coded_values(shape: tuple[int, int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (shape[0], 2 * shape[1]), generator=gen, dtype=torch.uint8)
    expected = f32([[ref_e2m1(c) for c in row] for row in codes.tolist()])
    assert_bitwise_equal(unpack_e2m1(pack_e2m1(codes)), expected)


# ----------------------------------------------------------------- decoder formulas


@FAST
@given(shape=shapes_2d, seed=st.integers(0, 2**31 - 1))
def test_dequant_mxfp8_matches_scalar_formula_for_any_bytes(
    shape: tuple[int, int], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, blocks = shape
    codes = random_bytes(gen, (n, blocks * MXFP8_BLOCK))
    scale = random_bytes(gen, (n, blocks))
    expected = [
        [
            ref_e4m3(codes[i, k].item()) * ref_e8m0(scale[i, k // MXFP8_BLOCK].item())
            for k in range(blocks * MXFP8_BLOCK)
        ]
        for i in range(n)
    ]
    out = dequant_mxfp8(codes.view(torch.float8_e4m3fn), scale)
    assert_bitwise_equal(out, f32(expected))


@FAST
@given(
    shape=shapes_2d,
    seed=st.integers(0, 2**31 - 1),
    global_scale=st.floats(2.0**-149, 2.0**100, width=32),  # float32 subnormals too
)
def test_dequant_nvfp4_matches_scalar_formula_for_any_bytes(
    shape: tuple[int, int], seed: int, global_scale: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, groups = shape
    packed = random_bytes(gen, (n, groups * NVFP4_GROUP // 2))
    scale = random_bytes(gen, (n, groups))
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, -1)
    # Exact in float64 (at most 30 significant bits), so f32() rounds once like the formula.
    expected = [
        [
            ref_e2m1(codes[i, k].item())
            * ref_e4m3(scale[i, k // NVFP4_GROUP].item())
            * global_scale
            for k in range(groups * NVFP4_GROUP)
        ]
        for i in range(n)
    ]
    out = dequant_nvfp4(
        packed,
        scale.view(torch.float8_e4m3fn),
        torch.tensor(global_scale, dtype=torch.float32),
    )
    assert_bitwise_equal(out, f32(expected))


def test_dequant_handles_leading_dims_like_stacked_matrices() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = random_bytes(gen, (3, 2, 64), exclude=E4M3_NAN_BYTES).view(torch.float8_e4m3fn)
    scale = random_bytes(gen, (3, 2, 2), exclude=(255,))
    stacked = torch.stack([dequant_mxfp8(codes[e], scale[e]) for e in range(3)])
    assert torch.equal(dequant_mxfp8(codes, scale), stacked)

    packed = random_bytes(gen, (3, 2, 16))
    nv_scale = random_bytes(gen, (3, 2, 2), exclude=E4M3_NAN_BYTES).view(torch.float8_e4m3fn)
    g = torch.tensor(0.25)
    stacked = torch.stack([dequant_nvfp4(packed[e], nv_scale[e], g) for e in range(3)])
    assert torch.equal(dequant_nvfp4(packed, nv_scale, g), stacked)


# ---------------------------------------------------------------- E2M1 rounding ladder


@pytest.mark.parametrize(
    ("y", "code"),
    [
        (0.25, 0),  # tie 0 | 0.5 -> even code 0
        (0.2500001, 1),
        (0.75, 2),  # tie 0.5 | 1 -> 1
        (1.25, 2),  # tie 1 | 1.5 -> 1
        (1.75, 4),  # tie 1.5 | 2 -> 2
        (2.5, 4),  # tie 2 | 3 -> 2
        (3.5, 6),  # tie 3 | 4 -> 4
        (5.0, 6),  # tie 4 | 6 -> 4
        (5.0000005, 7),
        (6.0, 7),
        (7.5, 7),  # saturates at 6
        (math.inf, 7),
        (-0.75, 0x8 | 2),
        (-6.5, 0x8 | 7),
        (-0.0, 0),  # negative zero encodes as +0
        (-0.25, 0),  # rounds to zero: +0, not -0
        (-1e-30, 0),
    ],
)
def test_e2m1_codes_follow_the_ladder_with_ties_to_even(y: float, code: int) -> None:
    assert e2m1_codes(torch.tensor([y])).tolist() == [code]


_ladder_points = st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).flatmap(
    lambda m: st.sampled_from([m, -m, math.nextafter(m, 0), math.nextafter(m, 9)])
)


@FAST
@given(ys=st.lists(st.floats(-8, 8, width=32) | _ladder_points, min_size=1, max_size=64))
def test_e2m1_codes_pick_nearest_magnitude_with_ties_to_even_code(ys: list[float]) -> None:
    y = torch.tensor(ys, dtype=torch.float32)
    expected = [ref_nearest_e2m1_code(v) for v in y.tolist()]
    assert e2m1_codes(y).tolist() == expected


def test_e2m1_codes_returns_uint8_with_input_shape() -> None:
    out = e2m1_codes(torch.zeros(2, 3, 4))
    assert out.dtype == torch.uint8
    assert out.shape == (2, 3, 4)
