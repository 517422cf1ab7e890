"""Tests for m3serve.kernels.quant: bit-exact MXFP8/NVFP4 decoding and ModelOpt-style encoding.

The decoders are checked against scalar reference decoders written here from the bit layouts,
so a shared misunderstanding between the module and torch's float8 would still be caught.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
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
    quant_mxfp8,
    quant_nvfp4,
    unpack_e2m1,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
E4M3_NAN_BYTES = (0x7F, 0xFF)
FAST = settings(max_examples=30, deadline=None)


# ----------------------------------------------------------- scalar reference decoders


def ref_e4m3(byte: int) -> float:
    """float8_e4m3fn: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8) * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def ref_e2m1(code: int) -> float:
    """E2M1: sign bit 3, 2-bit exponent (bias 1), 1-bit mantissa, subnormal at exponent 0."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent = (code >> 1) & 0x3
    mantissa = code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def ref_e8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def ref_nearest_e2m1_code(y: float) -> int:
    """Nearest E2M1 magnitude by brute force, ties to the even code; -0 never produced."""
    a = min(abs(y), 6.0)
    code = min(range(8), key=lambda i: (abs(a - E2M1_MAGNITUDES[i]), i % 2))
    return code | 0x8 if (y < 0 and code != 0) else code


def f32(values: list[float]) -> torch.Tensor:
    """Round Python floats (exact doubles) once to float32, as the formulas require."""
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 equality including the sign of zero; NaNs must sit in the same places."""
    assert actual.dtype == expected.dtype == torch.float32
    assert actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8)


def random_bytes(
    gen: torch.Generator, shape: tuple[int, ...], exclude: tuple[int, ...] = ()
) -> torch.Tensor:
    out = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    for bad in exclude:
        out = torch.where(out == bad, 0, out)
    return out.to(torch.uint8)


shapes_2d = st.tuples(st.integers(1, 4), st.integers(1, 4))


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


# ------------------------------------------------------------------- MXFP8 encoding


@pytest.mark.parametrize("device", DEVICES)
@FAST
@given(shape=shapes_2d, seed=st.integers(0, 2**31 - 1))
def test_mxfp8_representable_weights_round_trip_bit_exactly(
    device: str, shape: tuple[int, int], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, blocks = shape
    codes = random_bytes(gen, (n, blocks * MXFP8_BLOCK), exclude=E4M3_NAN_BYTES)
    # Exponent bytes from 0 (2**-127, float32 subnormal weights) up to well below overflow.
    scale = (random_bytes(gen, (n, blocks)).int() * 200 // 255).to(torch.uint8)
    w = dequant_mxfp8(codes.view(torch.float8_e4m3fn), scale).to(device)
    assert_bitwise_equal(dequant_mxfp8(*quant_mxfp8(w)).cpu(), w.cpu())


@FAST
@given(
    shape=shapes_2d,
    seed=st.integers(0, 2**31 - 1),
    log10_scale=st.integers(-40, 30),
    outlier=st.sampled_from([0.0, 1e2, 1e4, 1e6]),
    zero_block=st.booleans(),
)
def test_mxfp8_random_weights_round_trip_within_half_an_e4m3_ulp(
    shape: tuple[int, int], seed: int, log10_scale: int, outlier: float, zero_block: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, blocks = shape
    w = torch.randn(n, blocks * MXFP8_BLOCK, generator=gen) * 10.0**log10_scale
    w[0, 0] *= 1.0 + outlier
    if zero_block:
        w[-1, -MXFP8_BLOCK:] = 0.0
    codes, scale = quant_mxfp8(w)
    err = (dequant_mxfp8(codes, scale) - w).abs()
    block_step = e8m0_to_float(scale).repeat_interleave(MXFP8_BLOCK, dim=-1)
    # 3 mantissa bits: half an ulp is <= |x| / 16 for normals, 2**-10 of the block scale below.
    assert torch.all(err <= w.abs() / 16 + block_step * 2.0**-10)
    if zero_block:
        assert scale[-1, -1].item() == 0
        assert torch.all(e4m3_bytes(codes[-1, -MXFP8_BLOCK:]) == 0)


@FAST
@given(shape=shapes_2d, seed=st.integers(0, 2**31 - 1), log10_scale=st.integers(-44, 37))
def test_mxfp8_scale_is_smallest_exponent_keeping_block_within_448(
    shape: tuple[int, int], seed: int, log10_scale: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, blocks = shape
    w = torch.randn(n, blocks * MXFP8_BLOCK, generator=gen) * 10.0**log10_scale
    _, scale = quant_mxfp8(w)
    amax = w.abs().unflatten(-1, (blocks, MXFP8_BLOCK)).amax(-1).double()
    exponent = scale.double() - 127
    assert torch.all(amax <= 448 * 2.0**exponent)
    clamped = (exponent == -127) & (amax <= 448 * 2.0**-127)
    assert torch.all(clamped | (amax > 448 * 2.0 ** (exponent - 1)))


@pytest.mark.parametrize(
    ("amax", "byte", "decoded"),
    [
        (448.0, 127, 448.0),  # exactly 448 * 2**0: no need for a larger exponent
        (448.00003, 128, 448.0),  # one float32 ulp above: next exponent, 224.00002 -> 224
        (224.0, 126, 224.0),
        (224.00002, 127, 224.0),
        (1.0, 119, 1.0),  # 1 / 2**-8 = 256 <= 448 < 512
        (1e-45, 0, 0.0),  # would need 2**-158: clamped to 2**-127, code underflows to 0
        (0.0, 0, 0.0),
    ],
)
def test_mxfp8_exponent_boundaries_are_exact(amax: float, byte: int, decoded: float) -> None:
    w = torch.zeros(1, MXFP8_BLOCK)
    w[0, 5] = amax
    codes, scale = quant_mxfp8(w)
    assert scale.tolist() == [[byte]]
    assert dequant_mxfp8(codes, scale)[0, 5].item() == decoded


def test_mxfp8_all_zero_block_gets_scale_byte_0_and_zero_codes() -> None:
    codes, scale = quant_mxfp8(torch.zeros(2, 2 * MXFP8_BLOCK))
    assert codes.dtype == torch.float8_e4m3fn
    assert scale.dtype == torch.uint8
    assert torch.all(scale == 0)
    assert torch.all(e4m3_bytes(codes) == 0)


def test_mxfp8_keeps_leading_dims() -> None:
    w = torch.randn(3, 2, 2 * MXFP8_BLOCK)
    codes, scale = quant_mxfp8(w)
    assert codes.shape == (3, 2, 64)
    assert scale.shape == (3, 2, 2)
    assert torch.equal(e4m3_bytes(codes[1]), e4m3_bytes(quant_mxfp8(w[1])[0]))


# ------------------------------------------------------------------- NVFP4 encoding


def representable_nvfp4(
    seed: int, n: int, groups: int, log2_global: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [n, K], scales and a power-of-two global scale that the quantizer must reproduce.

    Every nonzero group holds a +-6, so its amax pins its scale; group (0, 0) has scale 448,
    so the tensor amax pins the global scale. The last group is all +-0 when there are two.
    """
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, groups, NVFP4_GROUP), generator=gen, dtype=torch.uint8)
    codes[..., 0] = torch.where(torch.rand(n, groups, generator=gen) < 0.5, 0x7, 0xF)
    if n * groups > 1:
        codes[-1, -1] = torch.where(torch.rand(NVFP4_GROUP, generator=gen) < 0.5, 0x0, 0x8)
    # Normal e4m3 scales 2**-6 .. 448 (bytes 0x08 .. 0x7E).
    scale_bytes = torch.randint(0x08, 0x7F, (n, groups), generator=gen, dtype=torch.uint8)
    scale_bytes[0, 0] = 0x7E
    return codes.flatten(-2), scale_bytes.view(torch.float8_e4m3fn), torch.tensor(2.0**log2_global)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pass_global_scale", [False, True])
@FAST
@given(shape=shapes_2d, seed=st.integers(0, 2**31 - 1), log2_global=st.integers(-40, 20))
def test_nvfp4_representable_weights_round_trip_bit_exactly(
    device: str, pass_global_scale: bool, shape: tuple[int, int], seed: int, log2_global: int
) -> None:
    codes, scale, g = representable_nvfp4(seed, *shape, log2_global)
    w = dequant_nvfp4(pack_e2m1(codes), scale, g).to(device)
    packed2, scale2, g2 = (t.cpu() for t in quant_nvfp4(w, g if pass_global_scale else None))
    assert_bitwise_equal(g2, g)
    assert torch.equal(dequant_nvfp4(packed2, scale2, g2), w.cpu())  # -0.0 == +0.0
    # Same codes except that -0 comes back as +0; same scales except for all-zero groups.
    assert torch.equal(packed2, pack_e2m1(torch.where(codes == 0x8, 0, codes)))
    nonzero = (codes & 0x7).unflatten(-1, (-1, NVFP4_GROUP)).amax(-1) > 0
    assert torch.equal(scale2.float()[nonzero], scale.float()[nonzero])
    assert torch.all(e4m3_bytes(scale2)[~nonzero] == 0)


@FAST
@given(
    shape=shapes_2d,
    seed=st.integers(0, 2**31 - 1),
    log10_scale=st.integers(-20, 20),
    outlier=st.sampled_from([0.0, 1e1, 1e2, 1e3]),
    zero_group=st.booleans(),
)
def test_nvfp4_random_weights_round_trip_within_e2m1_error_bounds(
    shape: tuple[int, int], seed: int, log10_scale: int, outlier: float, zero_group: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, groups = shape
    w = torch.randn(n, groups * NVFP4_GROUP, generator=gen) * 10.0**log10_scale
    w[0, 0] *= 1.0 + outlier
    if zero_group:
        w[-1, -NVFP4_GROUP:] = 0.0
    packed, scale, g = quant_nvfp4(w)
    err = (dequant_nvfp4(packed, scale, g) - w).abs()
    slack = 1 + 2.0**-16  # float32 rounding of the scale products and the quotient

    # Any group: nearest grid point of step = scale * g (half-gap <= max(step, |w|) / 4),
    # plus whatever lies beyond the saturation value 6 * step.
    step = (scale.float() * g).repeat_interleave(NVFP4_GROUP, dim=-1)
    clamp_excess = (w.abs() - 6 * step).clamp(min=0)
    assert torch.all(err <= torch.maximum(w.abs(), step) / 4 * slack + clamp_excess)

    # Groups whose ideal scale is a normal e4m3 (>= 2**-6): the scale is within 1/16 of
    # amax / (6 g), so error is bounded by the group's own amax, with no saturation loss.
    group_amax = w.abs().unflatten(-1, (groups, NVFP4_GROUP)).amax(-1)
    normal = (group_amax / (6 * g) >= 2.0**-6).repeat_interleave(NVFP4_GROUP, dim=-1)
    amax_bound = (group_amax * (17 / 16) / 24).repeat_interleave(NVFP4_GROUP, dim=-1)
    bound = torch.maximum(w.abs() / 4, amax_bound) * slack
    assert torch.all(err[normal] <= bound[normal])
    if zero_group:
        assert scale[-1, -1].float().item() == 0.0
        assert torch.all(err[-1, -NVFP4_GROUP:] == 0)


@FAST
@given(seed=st.integers(0, 2**31 - 1), log2_global=st.integers(-30, 10))
def test_nvfp4_divides_by_the_rounded_product_of_group_and_global_scale(
    seed: int, log2_global: int
) -> None:
    # Ladder ties make the rounding path visible: w / (s * g) and w / s / g disagree on ~1 in
    # 8 of these, and ModelOpt (hence the checkpoint) uses the product.
    gen = torch.Generator().manual_seed(seed)
    groups = 8
    g = ((1 + torch.rand((), generator=gen)) * 2.0**log2_global).to(torch.float32)
    scale_bytes = torch.randint(0x30, 0x7F, (1, groups), generator=gen, dtype=torch.uint8)
    step = scale_bytes.view(torch.float8_e4m3fn).float() * g
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -5.0])
    y = ties[torch.randint(0, len(ties), (1, groups, NVFP4_GROUP), generator=gen)]
    y[..., 0] = 6.0  # pins each group's scale to its byte above
    w = (y * step.unsqueeze(-1)).flatten(-2)
    packed, scale, _ = quant_nvfp4(w, g)
    assert torch.equal(e4m3_bytes(scale), scale_bytes)
    expected = e2m1_codes(w.unflatten(-1, (groups, NVFP4_GROUP)) / step.unsqueeze(-1))
    assert torch.equal(packed, pack_e2m1(expected.flatten(-2)))


def test_nvfp4_global_scale_follows_modelopt_amax_over_6_times_448() -> None:
    w = torch.zeros(2, 2 * NVFP4_GROUP)
    w[1, 7] = -5.0
    _, scale, g = quant_nvfp4(w)
    assert g.dtype == torch.float32
    assert g.dim() == 0
    assert g.item() == torch.tensor(5.0 / 2688, dtype=torch.float32).item()
    assert scale[1, 0].float().item() == 448.0  # the amax group gets the top e4m3 scale


def test_nvfp4_group_whose_scale_underflows_encodes_zeros() -> None:
    w = torch.full((1, 2 * NVFP4_GROUP), 1e-6)
    w[0, 0] = 1e4  # pushes group 1's ideal scale (~4.5e-8) below e4m3's smallest 2**-9
    packed, scale, g = quant_nvfp4(w)
    assert scale[0, 1].float().item() == 0.0
    assert torch.all(packed[0, NVFP4_GROUP // 2 :] == 0)
    assert torch.all(dequant_nvfp4(packed, scale, g)[0, NVFP4_GROUP:] == 0)


def test_nvfp4_all_zero_weight_encodes_zero_codes_scales_and_global_scale() -> None:
    packed, scale, g = quant_nvfp4(torch.zeros(2, 2 * NVFP4_GROUP))
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, NVFP4_GROUP)
    assert scale.dtype == torch.float8_e4m3fn
    assert scale.shape == (2, 2)
    assert torch.all(packed == 0)
    assert torch.all(e4m3_bytes(scale) == 0)
    assert g.item() == 0.0


def test_nvfp4_negative_zero_weights_encode_as_positive_zero_codes() -> None:
    w = torch.full((1, NVFP4_GROUP), -0.0)
    w[0, 1] = 1.0
    packed, _, _ = quant_nvfp4(w)
    assert packed[0, 0].item() & 0x0F == 0  # element 0 is -0.0: code 0, not 8


def test_nvfp4_keeps_leading_dims_with_a_shared_global_scale() -> None:
    w = torch.randn(3, 2, 2 * NVFP4_GROUP)
    g = float(w.abs().amax()) / 2688
    packed, scale, _ = quant_nvfp4(w, g)
    assert packed.shape == (3, 2, NVFP4_GROUP)
    assert scale.shape == (3, 2, 2)
    packed1, scale1, _ = quant_nvfp4(w[1], g)
    assert torch.equal(packed[1], packed1)
    assert torch.equal(e4m3_bytes(scale[1]), e4m3_bytes(scale1))


# ------------------------------------------------------------- shared global scale


def test_given_global_scale_is_returned_and_used_instead_of_own_amax() -> None:
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(4, 64, generator=gen) * 3
    w3 = torch.randn(4, 64, generator=gen)
    _, _, g1 = quant_nvfp4(w1)
    packed3, scale3, g3 = quant_nvfp4(w3, g1)
    assert_bitwise_equal(g3, g1)
    assert not torch.equal(g3, quant_nvfp4(w3)[2])
    group_amax = w3.abs().unflatten(-1, (4, NVFP4_GROUP)).amax(-1)
    assert torch.equal(scale3.float(), (group_amax / (6 * g1)).to(torch.float8_e4m3fn).float())
    # Within one grid step, which is at most amax / 6 plus the scale's 1/16 rounding.
    err = (dequant_nvfp4(packed3, scale3, g1) - w3).abs()
    assert torch.all(err <= (group_amax * 0.18).repeat_interleave(NVFP4_GROUP, -1))


def test_given_global_scale_equal_to_own_reproduces_default_encoding() -> None:
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    default = quant_nvfp4(w)
    for given_scale in (default[2], default[2].item()):
        packed, scale, g = quant_nvfp4(w, given_scale)
        assert torch.equal(packed, default[0])
        assert torch.equal(e4m3_bytes(scale), e4m3_bytes(default[1]))
        assert_bitwise_equal(g, default[2])


def test_doubling_global_scale_halves_group_scales_and_keeps_codes() -> None:
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    packed, scale, g = quant_nvfp4(w)
    assert torch.all(scale.float() >= 2.0**-5)  # halves stay normal e4m3, so exactly half
    packed2, scale2, g2 = quant_nvfp4(w, 2 * g)
    assert g2.item() == 2 * g.item()
    assert torch.equal(scale2.float(), scale.float() / 2)
    assert torch.equal(packed2, packed)


def test_too_small_global_scale_saturates_scales_at_448_instead_of_nan() -> None:
    w = torch.full((1, NVFP4_GROUP), 10.0)
    packed, scale, _ = quant_nvfp4(w, 1e-4)
    assert scale.float().item() == 448.0
    assert torch.all(unpack_e2m1(packed) == 6.0)


# -------------------------------------------------------------------------- errors


def fp8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape).to(torch.float8_e4m3fn)


def u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


G = torch.tensor(1.0)


@pytest.mark.parametrize(
    ("call", "expected", "actual"),
    [
        (lambda: dequant_mxfp8(fp8(4, 64), u8(4, 3)), r"\(4, 2\)", r"\(4, 3\)"),
        (lambda: dequant_mxfp8(fp8(3, 4, 64), u8(2, 4, 2)), r"\(3, 4, 2\)", r"\(2, 4, 2\)"),
        (lambda: dequant_mxfp8(fp8(4, 48), u8(4, 1)), "divisible by 32", r"\(4, 48\)"),
        (lambda: dequant_mxfp8(torch.zeros(4, 64), u8(4, 2)), "float8_e4m3fn", "float32"),
        (lambda: dequant_mxfp8(fp8(4, 64), u8(4, 2).to(torch.int8)), "uint8", "int8"),
        (lambda: e8m0_to_float(torch.zeros(3)), "uint8", "float32"),
        (lambda: quant_mxfp8(torch.zeros(4, 48)), "divisible by 32", r"\(4, 48\)"),
        (lambda: quant_mxfp8(torch.zeros(4, 64, dtype=torch.int32)), "floating", "int32"),
        (lambda: quant_mxfp8(torch.tensor([[math.inf] * 32])), "finite", "inf"),
        (lambda: unpack_e2m1(torch.zeros(4, 8, dtype=torch.int8)), "uint8", "int8"),
        (lambda: pack_e2m1(u8(4, 7)), "divisible by 2", r"\(4, 7\)"),
        (lambda: pack_e2m1(u8(4, 8) + 16), "0..15", "16"),
        (lambda: dequant_nvfp4(u8(4, 30), fp8(4, 4), G), r"\(4, 32\)", r"\(4, 30\)"),
        (lambda: dequant_nvfp4(u8(2, 4, 32), fp8(3, 4, 4), G), r"\(3, 4, 32\)", r"\(2, 4, 32\)"),
        (lambda: dequant_nvfp4(u8(4, 32), u8(4, 4), G), "float8_e4m3fn", "uint8"),
        (lambda: dequant_nvfp4(u8(4, 32), fp8(4, 4), torch.ones(1)), r"\(\)", r"\(1,\)"),
        (lambda: dequant_nvfp4(u8(4, 32), fp8(4, 4), G.half()), "float32", "float16"),
        (lambda: dequant_nvfp4(fp8(4, 32), fp8(4, 4), G), "uint8", "float8_e4m3fn"),
        (lambda: quant_nvfp4(torch.zeros(4, 24)), "divisible by 16", r"\(4, 24\)"),
        (lambda: quant_nvfp4(torch.ones(4, 32), -1.0), ">= 0", "-1.0"),
        (lambda: quant_nvfp4(torch.ones(4, 32), 0.0), "> 0", "amax 1.0"),
        (lambda: quant_nvfp4(torch.tensor([[math.nan] * 16])), "finite", "nan"),
    ],
)
def test_bad_shapes_and_dtypes_raise_value_error_naming_expected_and_actual(
    call: Callable[[], object], expected: str, actual: str
) -> None:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert re.search(expected, message), message
    assert re.search(actual, message), message
