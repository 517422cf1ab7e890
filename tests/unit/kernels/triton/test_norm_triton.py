"""Triton Gemma RMSNorm (and the fused residual add) against the torch reference.

On CPU this runs in Triton's interpreter, whose fp32 -> bf16 cast truncates instead of rounding
to nearest even; bf16 results are therefore held to one bf16 ulp of the reference, fp32
results to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.kernels.norm import add_gemma_rms_norm, gemma_rms_norm
from m3serve.kernels.triton.norm import add_rms_norm, rms_norm

EPS = 1e-6


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def assert_within_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: fp32 rounding. bf16: at most one bf16 ulp of the reference value apart."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        return
    g, r = got.float(), ref.float()
    ulp = torch.finfo(ref.dtype).eps * torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))))
    bad = (g - r).abs() > ulp
    assert not bad.any(), f"{int(bad.sum())} elements beyond one ulp: {g[bad][:4]} vs {r[bad][:4]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 48)])
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # 48 is not a power of two: the masked tail must not enter the mean.
    x = randn(*shape, seed=1, scale=4.0).to(dtype)
    w = randn(shape[-1], seed=2, scale=0.5).to(dtype)
    got = rms_norm(x, w, EPS)
    assert got.shape == x.shape and got.dtype == dtype
    assert_within_ulp(got, gemma_rms_norm(x, w, EPS))


def test_rms_norm_row_strided_input_and_out_buffer() -> None:
    wide = randn(6, 96, seed=3, scale=2.0)
    x = wide[:, 16:80]  # rows 96 apart, last dim contiguous
    w = randn(64, seed=4, scale=0.5)
    out = torch.full((6, 64), float("nan"), device=DEVICE)
    got = rms_norm(x, w, EPS, out=out)
    assert got is out
    assert_within_ulp(out, gemma_rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_residual_in_place(dtype: torch.dtype) -> None:
    x = randn(4, 64, seed=5, scale=3.0).to(dtype)
    residual = randn(4, 64, seed=6, scale=3.0).to(dtype)
    w = randn(64, seed=7, scale=0.5)
    ref_normed, ref_res = add_gemma_rms_norm(x, residual.clone(), w, EPS)
    ptr = residual.data_ptr()
    normed, res = add_rms_norm(x, residual, w, EPS)
    assert res is residual and res.data_ptr() == ptr
    assert_within_ulp(res, ref_res)
    # Normalize the residual the kernel stored: on a GPU it equals ref_res exactly; in the
    # interpreter it may sit one ulp off, and the norm must follow the stored value.
    assert_within_ulp(normed, gemma_rms_norm(res, w, EPS))
    if dtype == torch.float32:
        torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-6)


def test_add_rms_norm_without_residual_copies_x() -> None:
    x = randn(3, 2, 64, seed=8, scale=3.0).bfloat16()
    w = randn(64, seed=9, scale=0.5).bfloat16()
    keep = x.clone()
    normed, res = add_rms_norm(x, None, w, EPS)
    assert res.data_ptr() != x.data_ptr()
    assert torch.equal(res, x) and torch.equal(x, keep)
    assert_within_ulp(normed, gemma_rms_norm(x, w, EPS))


def test_gemma_offset_is_one_plus_weight() -> None:
    # rms of [3, -4] is sqrt(12.5); a zero weight keeps the normalized value, w = 1 doubles it.
    x = torch.tensor([[3.0, -4.0]], device=DEVICE)
    w = torch.tensor([0.0, 1.0], device=DEVICE)
    got = rms_norm(x, w, 0.0)
    rms = 12.5**0.5
    torch.testing.assert_close(got, torch.tensor([[3.0 / rms, -8.0 / rms]], device=DEVICE))


def test_rejects_mismatched_shapes() -> None:
    x = randn(2, 64, seed=10)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(32, seed=11), EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, randn(2, 32, seed=12), randn(64, seed=13), EPS)
    with pytest.raises(ValueError, match="last dimension"):
        rms_norm(randn(64, 2, seed=14).t(), randn(64, seed=15), EPS)
