"""Exact encode/decode of the weight formats of MiniMax-M3.1's ModelOpt MIXED_PRECISION checkpoint.

This module owns the bit-level meaning of quantized weights and nothing else:

* MXFP8 (dense projections): float8_e4m3fn codes [..., K] plus one E8M0 exponent byte per
  32-element block along K, [..., K/32].
* NVFP4 (routed experts): E2M1 codes packed two per byte [..., K/2] (element 2i in the low
  nibble), one float8_e4m3fn scale per 16-element group [..., K/16], and a float32 0-d global
  scale.

Decoders reproduce the checkpoint's values bit for bit in float32. Encoders follow ModelOpt's
quantizer so that checkpoints written by the tiny-model writer are indistinguishable from real
ones. Nothing here knows tensor names; the loader prefixes them to the ValueErrors raised here.
"""

from __future__ import annotations

import itertools
import math

import torch

MXFP8_BLOCK: int = 32
NVFP4_GROUP: int = 16
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_E4M3_MAX = 448.0
_E2M1_MAX = E2M1_MAGNITUDES[-1]
_E2M1_SIGN = 0x8
_E8M0_BIAS = 127
_E8M0_NAN = 255
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127
# float32 bit patterns used to build 2**(byte - 127) without any arithmetic that could round.
_F32_MANTISSA_BITS = 23
_F32_TWO_POW_MINUS_127 = 1 << 22  # below float32's normal range: the top subnormal bit
_F32_QUIET_NAN = 0x7FC00000
# 448 == 0.875 * 2**9: the frexp mantissa threshold that decides the MXFP8 shared exponent.
_E4M3_MAX_FREXP_MANTISSA = 0.875
_E4M3_MAX_FREXP_EXPONENT = 9


def _e2m1_decisions() -> tuple[tuple[float, bool], ...]:
    """(midpoint, tie rounds up) between each pair of neighbouring E2M1 magnitudes.

    Round-half-to-even on the code: a tie goes up exactly when the upper code is even.
    """
    return tuple(
        ((lo + hi) / 2, (upper_code % 2) == 0)
        for upper_code, (lo, hi) in enumerate(itertools.pairwise(E2M1_MAGNITUDES), start=1)
    )


_E2M1_DECISIONS = _e2m1_decisions()


# --------------------------------------------------------------------------- validation


def _require_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{what}: expected dtype {dtype}, got {t.dtype}")


def _inner_dim(t: torch.Tensor, multiple: int, what: str) -> int:
    """The last dim K of ``t``, which must exist and be a multiple of ``multiple``."""
    if t.dim() == 0 or t.shape[-1] % multiple != 0:
        raise ValueError(
            f"{what}: expected shape [..., K] with K divisible by {multiple}, got {tuple(t.shape)}"
        )
    return t.shape[-1]


def _require_shape(t: torch.Tensor, expected: tuple[int, ...], what: str, rule: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{what}: expected shape {expected} ({rule}), got {tuple(t.shape)}")


def _finite_float32(w: torch.Tensor, what: str) -> torch.Tensor:
    """``w`` as float32; the encoders have no representation for inf/nan inputs."""
    if not w.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point dtype, got {w.dtype}")
    wf = w.to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise ValueError(f"{what}: expected finite values, got inf or nan")
    return wf


# ------------------------------------------------------------------------------ MXFP8


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 exponent bytes to float32 ``2**(byte - 127)``; byte 255 is NaN."""
    _require_dtype(exponents, torch.uint8, "exponents")
    e = exponents.to(torch.int32)
    # Writing the bit pattern is exact on every backend, unlike exp2/pow; byte 0 (2**-127)
    # has no normal float32 encoding, so it gets the subnormal one.
    bits = e << _F32_MANTISSA_BITS
    bits = torch.where(e == 0, _F32_TWO_POW_MINUS_127, bits)
    bits = torch.where(e == _E8M0_NAN, _F32_QUIET_NAN, bits)
    return bits.view(torch.float32)


def dequant_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``W[..., k] = float(weight[..., k]) * 2**(scale[..., k // 32] - 127)`` in float32."""
    _require_dtype(weight, torch.float8_e4m3fn, "weight")
    _require_dtype(scale, torch.uint8, "scale")
    k = _inner_dim(weight, MXFP8_BLOCK, "weight")
    expected = (*weight.shape[:-1], k // MXFP8_BLOCK)
    rule = f"[..., K/{MXFP8_BLOCK}] for weight {tuple(weight.shape)}"
    _require_shape(scale, expected, "scale", rule)
    blocks = weight.to(torch.float32).unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK))
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def _mxfp8_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with ``block_amax / 2**e <= 448``, clamped to E8M0's range (int32).

    frexp keeps this exact: ``ceil(log2(amax / 448))`` in floating point is off by one at
    some powers of two.
    """
    mantissa, exponent = torch.frexp(block_amax)
    above = (mantissa > _E4M3_MAX_FREXP_MANTISSA).to(torch.int32)
    e = exponent - _E4M3_MAX_FREXP_EXPONENT + above
    # frexp(0) reports exponent 0; an empty block takes the smallest scale instead.
    e = torch.where(block_amax == 0, _E8M0_MIN_EXP, e)
    return e.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)


def quant_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``w [..., K]`` as (float8_e4m3fn codes [..., K], E8M0 bytes [..., K/32])."""
    wf = _finite_float32(w, "w")
    k = _inner_dim(wf, MXFP8_BLOCK, "w")
    blocks = wf.unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK))
    exponent = _mxfp8_exponent(blocks.abs().amax(dim=-1))
    scale = (exponent + _E8M0_BIAS).to(torch.uint8)
    # Dividing by a power of two is exact, and the exponent keeps every quotient <= 448, so
    # the cast's round-to-nearest-even is the only rounding and never saturates.
    codes = (blocks / e8m0_to_float(scale).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scale


# ------------------------------------------------------------------------------ NVFP4


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 value of each 4-bit code; code 8 is -0.0, as its sign bit says."""
    values = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
    return torch.tensor(values, dtype=torch.float32, device=device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed E2M1 bytes [..., K/2] to float32 [..., K]; element 2i is the low nibble."""
    _require_dtype(packed, torch.uint8, "packed")
    if packed.dim() == 0:
        raise ValueError(f"packed: expected shape [..., K/2], got {tuple(packed.shape)}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return _e2m1_table(packed.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., K] two per byte [..., K/2], element 2i in the low nibble."""
    _require_dtype(codes, torch.uint8, "codes")
    _inner_dim(codes, 2, "codes")
    if codes.numel() > 0 and int(codes.max()) > 0x0F:
        raise ValueError(f"codes: expected 4-bit values 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round ``y`` to the nearest E2M1 value (ties to the even code) and return uint8 codes.

    |y| saturates at 6. A magnitude that rounds to 0 is always code 0 (+0), never -0. NaN has
    no E2M1 encoding and maps to code 0; callers reject non-finite weights before this.
    """
    magnitude = y.abs()
    codes = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    # Seven monotone thresholds: the count of those passed is the magnitude code.
    for midpoint, tie_rounds_up in _E2M1_DECISIONS:
        codes += (magnitude >= midpoint) if tie_rounds_up else (magnitude > midpoint)
    negative = (y < 0) & (codes != 0)
    return torch.where(negative, codes | _E2M1_SIGN, codes)


def dequant_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """``W[..., k] = e2m1(code) * float(weight_scale[..., k // 16]) * weight_scale_2`` (float32).

    The multiplications run left to right as written: e2m1 * e4m3 is exact in float32, so the
    result is rounded once, by the global scale; another order would round twice.
    """
    _require_dtype(weight, torch.uint8, "weight")
    _require_dtype(weight_scale, torch.float8_e4m3fn, "weight_scale")
    _require_dtype(weight_scale_2, torch.float32, "weight_scale_2")
    if weight_scale_2.dim() != 0:
        raise ValueError(
            f"weight_scale_2: expected a 0-d tensor, shape (), got {tuple(weight_scale_2.shape)}"
        )
    if weight_scale.dim() == 0:
        raise ValueError(
            f"weight_scale: expected shape [..., K/{NVFP4_GROUP}], got {tuple(weight_scale.shape)}"
        )
    groups = weight_scale.shape[-1]
    k = groups * NVFP4_GROUP
    expected = (*weight_scale.shape[:-1], k // 2)
    rule = f"[..., K/2] with K = {NVFP4_GROUP} * weight_scale.shape[-1] = {k}"
    _require_shape(weight, expected, "weight", rule)
    values = unpack_e2m1(weight).unflatten(-1, (groups, NVFP4_GROUP))
    return (values * weight_scale.to(torch.float32).unsqueeze(-1) * weight_scale_2).flatten(-2)


def _nvfp4_global_scale(amax: torch.Tensor, given: float | torch.Tensor | None) -> torch.Tensor:
    """The float32 0-d global scale: ModelOpt's ``amax / (6 * 448)`` unless one is given."""
    if given is None:
        return amax / (_E2M1_MAX * _E4M3_MAX)
    scale = torch.tensor(float(given), dtype=torch.float32, device=amax.device)
    value = float(scale)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"weight_scale_2: expected a finite value >= 0, got {value}")
    if value == 0 and float(amax) > 0:
        raise ValueError(f"weight_scale_2: expected > 0 for a nonzero weight (amax {float(amax)})")
    return scale


def _nvfp4_block_scale(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn per-group scale ``e4m3(block_amax / (6 * global_scale))``."""
    ratio = block_amax / (_E2M1_MAX * global_scale)
    # An all-zero weight has global scale 0 (0/0 above). The clamp matters only for a caller's
    # too-small shared scale: torch versions disagree on whether >448 casts to 448 or NaN.
    ratio = torch.where(global_scale > 0, ratio, 0.0).clamp(max=_E4M3_MAX)
    return ratio.to(torch.float8_e4m3fn)


def quant_nvfp4(
    w: torch.Tensor, weight_scale_2: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``w [..., K]`` as (packed uint8 [..., K/2], e4m3 scales [..., K/16], float32 0-d).

    ``weight_scale_2`` overrides the global scale so that tensors fused at load time (w1 and
    w3 of one expert) can share one, as the checkpoint does.
    """
    wf = _finite_float32(w, "w")
    k = _inner_dim(wf, NVFP4_GROUP, "w")
    amax = wf.abs().amax() if wf.numel() > 0 else wf.new_zeros(())
    global_scale = _nvfp4_global_scale(amax, weight_scale_2)
    blocks = wf.unflatten(-1, (k // NVFP4_GROUP, NVFP4_GROUP))
    block_scale = _nvfp4_block_scale(blocks.abs().amax(dim=-1), global_scale)
    # ModelOpt divides by the product of the two scales, not by each in turn.
    step = (block_scale.to(torch.float32) * global_scale).unsqueeze(-1)
    codes = torch.where(step > 0, e2m1_codes(blocks / step), 0)
    return pack_e2m1(codes.flatten(-2)), block_scale, global_scale
