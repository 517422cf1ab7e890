"""The Triton side of `m3serve.kernels.triton.rope_kv` (whose docstring gives the semantics):
RMSNorm + partial NeoX RoPE of a block of heads, the e4m3 cache cast, and `heads_kernel`, one
program per (token, block of heads, part)."""

from __future__ import annotations

import triton
import triton.language as tl

# fp32(2*pi) and the remainder 2*pi - fp32(2*pi): a two-term Cody-Waite split for the angle.
# Kernels may read only constexpr globals.
_TWO_PI_HI = tl.constexpr(6.2831854820251465)
_TWO_PI_LO = tl.constexpr(-1.7484556025237907e-07)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(pos_f, inv_freq):
    """cos/sin of the fp32 angle pos * inv_freq, accurate for angles up to ~1e7.

    The reference takes torch's fp32 cos/sin of the rounded product. Positions reach 1M and the
    first frequency is 1, so the angle is ~1e6 rad; a fast hardware sin/cos is only accurate on
    [-pi, pi], so the angle is reduced first (Cody-Waite, 2*pi split in two fp32 parts).
    fma(-k, HI, a) is exact: k = 0 below pi, and above it a and k * HI are both multiples of
    2**-22 whose difference is below 4, i.e. fits 24 bits. The LO term adds one rounding of
    ~2**-23 rad, far below what bf16 outputs can see.
    """
    angle = pos_f * inv_freq
    k = tl.floor(angle * _INV_TWO_PI + 0.5)
    r = tl.fma(-k, _TWO_PI_HI, angle)
    r = tl.fma(-k, _TWO_PI_LO, r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _norm_rope_tile(
    x_ptr,
    stride_h,
    heads,
    h_mask,
    w_ptr,
    eps,
    pos_f,
    inv_freq_ptr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Normalize and rotate the [BLOCK_H, BLOCK_D] tile of one token at x_ptr; fp32 result."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = h_mask[:, None] & d_mask[None, :]
    row_ptrs = x_ptr + heads[:, None] * stride_h
    x = tl.load(row_ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    y = (x * rstd[:, None]) * (1.0 + w[None, :])

    # The rotation partner of channel i < rotary_dim is i +- rotary_dim/2. Registers cannot be
    # permuted across lanes, so the partner's normalized value is recomputed from a second load
    # of the same (cache-hot) row with the very same fp32 operations.
    rot = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    p_mask = h_mask[:, None] & rot[None, :]
    xp = tl.load(row_ptrs + partner[None, :], mask=p_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = (xp * rstd[:, None]) * (1.0 + wp[None, :])

    # One angle per frequency, shared by every head of the token.
    freq = tl.load(inv_freq_ptr + tl.where(first, d, d - HALF), mask=rot, other=0.0)
    cos, sin = _cos_sin(pos_f, freq)
    # rotate_half: the first half takes -partner, the second half +partner.
    sin = tl.where(first, -sin, sin)
    rotated = y * cos[None, :] + yp * sin[None, :]
    return tl.where(rot[None, :], rotated, y)


@triton.jit
def _round_e4m3(x):
    """Round fp32 `x` (already within +-448) to the nearest e4m3 value, ties to even, in fp32.

    Adding 1.5 * 2**(e + 20) leaves exactly the e4m3 quantum 2**(e - 3) of x's binade (e is
    x's exponent, floored at -6 where e4m3 turns subnormal), so the fp32 add rounds like the
    e4m3 cast. Doing it here keeps the result independent of how the cast below rounds (the
    Triton interpreter's cast does not round to nearest even). Without fast-math LLVM does not
    fold (x + m) - m. NaN stays NaN; x's sign bit is put back so -0 stays -0.
    """
    bits = x.to(tl.uint32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 121)
    magic = (((exp + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (x + magic) - magic
    sign = bits & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_cache(x, cache_ptr, FP8: tl.constexpr):
    """Quantize fp32 `x` to the cache's element type (scale 1.0)."""
    if FP8:
        # Saturate instead of turning out-of-range values into NaN; keep NaN visible.
        x = tl.minimum(tl.maximum(x, -448.0, tl.PropagateNan.ALL), 448.0, tl.PropagateNan.ALL)
        x = _round_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _heads_out(
    x_ptr,
    stride_xt,
    stride_xh,
    out_ptr,
    stride_ot,
    stride_oh,
    w_ptr,
    heads,
    block,
    t,
    pos_f,
    inv_freq_ptr,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Heads [block * BLOCK_H, ...) of token t: normalized, rotated, stored to out."""
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    y = _norm_rope_tile(
        x_ptr + t * stride_xt, stride_xh, h, h_mask, w_ptr, eps, pos_f, inv_freq_ptr, D, HALF,
        BLOCK_D,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    mask = h_mask[:, None] & (d < D)[None, :]
    ptrs = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _heads_to_cache(
    k_ptr,
    stride_kt,
    stride_kh,
    w_ptr,
    kc_ptr,
    stride_kcs,
    stride_kch,
    v_ptr,
    stride_vt,
    stride_vh,
    vc_ptr,
    stride_vcs,
    stride_vch,
    heads,
    block,
    t,
    slot,
    pos_f,
    inv_freq_ptr,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_V: tl.constexpr,
    FP8: tl.constexpr,
):
    """Heads [block * BLOCK_H, ...) of token t's keys: normalized, rotated, written to the cache
    at `slot`; with HAS_V the values beside them, as they are."""
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    d = tl.arange(0, BLOCK_D)
    mask = h_mask[:, None] & (d < D)[None, :]
    k = _norm_rope_tile(
        k_ptr + t * stride_kt, stride_kh, h, h_mask, w_ptr, eps, pos_f, inv_freq_ptr, D, HALF,
        BLOCK_D,
    )  # fmt: skip
    # The reference rounds the rotated key to k's dtype before the cache cast; for a bf16 key
    # and an fp8 cache the double rounding can differ from a direct one, so keep it.
    k = k.to(k_ptr.dtype.element_ty).to(tl.float32)
    kc_ptrs = kc_ptr + slot * stride_kcs + h[:, None] * stride_kch + d[None, :]
    tl.store(kc_ptrs, _to_cache(k, kc_ptr, FP8), mask=mask)
    if HAS_V:
        v_ptrs = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
        vc_ptrs = vc_ptr + slot * stride_vcs + h[:, None] * stride_vch + d[None, :]
        tl.store(vc_ptrs, _to_cache(v, vc_ptr, FP8), mask=mask)


@triton.jit
def heads_kernel(
    pos_ptr,
    inv_freq_ptr,
    slot_ptr,
    eps,
    q_ptr,
    stride_qt,
    stride_qh,
    qo_ptr,
    stride_qot,
    stride_qoh,
    qw_ptr,
    q_heads,
    iq_ptr,
    stride_iqt,
    stride_iqh,
    iqo_ptr,
    stride_iqot,
    stride_iqoh,
    iqw_ptr,
    iq_heads,
    k_ptr,
    stride_kt,
    stride_kh,
    kw_ptr,
    kc_ptr,
    stride_kcs,
    stride_kch,
    v_ptr,
    stride_vt,
    stride_vh,
    vc_ptr,
    stride_vcs,
    stride_vch,
    kv_heads,
    ik_ptr,
    stride_ikt,
    ikw_ptr,
    ikc_ptr,
    stride_ikcs,
    D: tl.constexpr,
    DI: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    IQ_BLOCKS: tl.constexpr,
    BLOCK_HIQ: tl.constexpr,
    KV_BLOCKS: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HAS_V: tl.constexpr,
    FP8: tl.constexpr,
    IK: tl.constexpr,
    IK_FP8: tl.constexpr,
):
    """Program (t, j): token t's j-th block of heads, in the order q, index q, k (+ v), index k.
    A part with no blocks is absent (its pointers are placeholders)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos_f = tl.load(pos_ptr + t).to(tl.float32)
    if j < Q_BLOCKS:
        _heads_out(
            q_ptr, stride_qt, stride_qh, qo_ptr, stride_qot, stride_qoh, qw_ptr, q_heads, j, t,
            pos_f, inv_freq_ptr, eps, D, HALF, BLOCK_HQ, BLOCK_D,
        )  # fmt: skip
    elif j < Q_BLOCKS + IQ_BLOCKS:
        _heads_out(
            iq_ptr, stride_iqt, stride_iqh, iqo_ptr, stride_iqot, stride_iqoh, iqw_ptr, iq_heads,
            j - Q_BLOCKS, t, pos_f, inv_freq_ptr, eps, DI, HALF, BLOCK_HIQ, BLOCK_DI,
        )  # fmt: skip
    elif j < Q_BLOCKS + IQ_BLOCKS + KV_BLOCKS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        _heads_to_cache(
            k_ptr, stride_kt, stride_kh, kw_ptr, kc_ptr, stride_kcs, stride_kch, v_ptr,
            stride_vt, stride_vh, vc_ptr, stride_vcs, stride_vch, kv_heads,
            j - Q_BLOCKS - IQ_BLOCKS, t, slot, pos_f, inv_freq_ptr, eps, D, HALF, BLOCK_HKV,
            BLOCK_D, HAS_V, FP8,
        )  # fmt: skip
    elif IK:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        _heads_to_cache(
            ik_ptr, stride_ikt, 0, ikw_ptr, ikc_ptr, stride_ikcs, 0, ik_ptr, 0, 0, ikc_ptr, 0, 0,
            1, 0, t, slot, pos_f, inv_freq_ptr, eps, DI, HALF, 1, BLOCK_DI, False, IK_FP8,
        )  # fmt: skip
