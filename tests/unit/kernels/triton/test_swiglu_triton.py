"""Triton SwiGLU-OAI (m3serve.kernels.triton.swiglu) against the torch reference `swiglu_oai`.

On CPU this runs in Triton's interpreter. Inputs span the +-7 clamp, so both clamps and the
unclamped middle are exercised. fp32 is held to fp32 rounding (the kernel's sigmoid may differ
from torch's by a few ulps); bf16 to one bf16 ulp of the exact (fp32) value, closer than torch's
six bf16 roundings get.
"""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.kernels.activation import swiglu_oai as reference
from m3serve.kernels.triton.swiglu import swiglu_oai

ALPHA, LIMIT = 1.702, 7.0


def gate_up(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=g) * 6.0).to(DEVICE)


@pytest.mark.parametrize("rows,width", [(1, 32), (5, 48), (3, 1100)])
def test_swiglu_matches_reference_in_fp32(rows: int, width: int) -> None:
    # 48 and 1100 are not block multiples: the masked tail must not be written.
    x = gate_up(rows, width, seed=rows)
    assert (x[:, :width] > LIMIT).any() and (x[:, width:].abs() > LIMIT).any()
    got = swiglu_oai(x, ALPHA, LIMIT)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, ALPHA, LIMIT), rtol=2e-6, atol=1e-6)


def test_swiglu_bf16_is_the_fp32_result_rounded_once() -> None:
    x = gate_up(4, 64, seed=9).to(torch.bfloat16)
    got = swiglu_oai(x, ALPHA, LIMIT)
    assert got.dtype == torch.bfloat16
    exact = reference(x.float(), ALPHA, LIMIT)
    # The interpreter's fp32 -> bf16 cast truncates: within one bf16 ulp of the exact value.
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert ((got.float() - exact).abs() <= ulp).all()
    # torch's six bf16 roundings drift further from the exact value (whole-tensor error).
    torch_bf16 = reference(x, ALPHA, LIMIT).float()
    assert float((torch_bf16 - got.float()).norm() / exact.norm()) < 1e-2


def test_swiglu_takes_strided_rows_and_leading_dims() -> None:
    wide = gate_up(6, 40, seed=3)  # rows of 80; take a [2, 3, 64] view with row stride 80
    x = wide[:, :64].reshape(2, 3, 64)
    got = swiglu_oai(x, ALPHA, LIMIT)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, reference(x, ALPHA, LIMIT), rtol=2e-6, atol=1e-6)


def test_swiglu_passes_nan_through_the_clamps() -> None:
    x = gate_up(1, 32, seed=4)
    x[0, 3] = float("nan")  # a gate
    x[0, 32 + 5] = float("nan")  # an up
    got = swiglu_oai(x, ALPHA, LIMIT)
    assert torch.isnan(got[0, 3]) and torch.isnan(got[0, 5])
    assert torch.isfinite(got[0, [0, 1, 2, 4, 6]]).all()


def test_swiglu_refuses_an_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        swiglu_oai(torch.zeros(2, 7, device=DEVICE), ALPHA, LIMIT)
