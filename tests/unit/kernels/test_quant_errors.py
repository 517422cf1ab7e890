"""m3serve.kernels.quant refuses bad shapes and dtypes with a message naming what it expected."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch

from m3serve.kernels.quant import (
    dequant_mxfp8,
    dequant_nvfp4,
    e8m0_to_float,
    pack_e2m1,
    quant_mxfp8,
    quant_nvfp4,
    unpack_e2m1,
)

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
