"""m3serve.kernels.quant's ModelOpt-style MXFP8 and NVFP4 encoding: round trips, scale choice,
edge cases and a shared NVFP4 global scale.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from m3serve.kernels.quant import (
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

from .quant_refs import (
    DEVICES,
    E4M3_NAN_BYTES,
    FAST,
    assert_bitwise_equal,
    e4m3_bytes,
    random_bytes,
    shapes_2d,
)

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
