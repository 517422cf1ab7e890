"""What the m3serve.kernels.quant tests share: scalar reference decoders written from the bit
layouts (so a misunderstanding shared by the module and torch's float8 would still be caught),
tensor builders and the hypothesis settings.
"""

from __future__ import annotations

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

from m3serve.kernels.quant import (
    E2M1_MAGNITUDES,
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
