"""Per-head Gemma RMSNorm + partial NeoX RoPE in Triton, fused with the KV-cache writes.

Semantics are the reference backend's `head_norm_rope` and `store_kv`: each head vector is
normalized in fp32 and scaled by (1 + w); the first `rotary_dim` channels rotate in pairs
(i, i + rotary_dim/2) by the fp32 angle positions * inv_freq; the rest pass through; the
result is cast once to the input dtype. Cache writes then cast that result to the cache dtype
(bf16, or float8_e4m3fn with scale 1.0, saturating at +-448: what a plain torch cast does
past that differs between builds and devices, NaN on some).

One kernel, `_heads_kernel`, for every projection family, alone or together:
  - `norm_rope`: q or the indexer's q, returned (or written to `out`);
  - `norm_rope_write_kv`: k is normalized and rotated, then k and v go straight to the caches;
  - `norm_rope_write_index_k`: the single index-key head, straight to the index-K cache;
  - `norm_rope_heads`: all of a layer's at once, one launch where the parts took four (at batch
    1 each was a ~2 µs kernel, mostly its launch and its one round trip to memory).

A program handles one token and a block of heads of one part. Grids depend only on shapes, and
slots and positions are read on the device, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

# fp32(2*pi) and the remainder 2*pi - fp32(2*pi): a two-term Cody-Waite split for the angle.
# Kernels may read only constexpr globals.
_TWO_PI_HI = tl.constexpr(6.2831854820251465)
_TWO_PI_LO = tl.constexpr(-1.7484556025237907e-07)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)

# Aim for ~2K elements per program: a [heads, head_dim] tile of 16 x 128 for the model.
_TILE_ELEMS = 2048


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
def _heads_kernel(
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


def _heads_view_ok(x: Tensor, name: str, dims: int) -> None:
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _rope_args(
    x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor
) -> tuple[int, int, int]:
    """Check the shared arguments; return (head_dim, rotary_dim / 2, BLOCK_D)."""
    t, d = x.shape[0], x.shape[-1]
    half = inv_freq.numel()
    if weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"norm weight must be a contiguous [{d}] tensor")
    if positions.shape != (t,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be a [{t}] integer tensor")
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous():
        raise ValueError("inv_freq must be a contiguous 1-D float32 tensor")
    if half == 0 or 2 * half > d:
        raise ValueError(f"rotary_dim {2 * half} does not fit head_dim {d}")
    return d, half, triton.next_power_of_2(d)


def _block_h(heads: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(heads), _TILE_ELEMS // block_d))


@dataclass(frozen=True)
class _Rotated:
    """Heads normalized, rotated and stored to `out`: x, out [T, H, D]."""

    x: Tensor
    weight: Tensor
    out: Tensor


@dataclass(frozen=True)
class _Cached:
    """Keys [T, H, D] normalized, rotated and written to `cache` [slots, H, D] (and values, as
    they are, to `v_cache`); the index key is one head, [T, D] into [slots, D]."""

    k: Tensor
    weight: Tensor
    cache: Tensor
    v: Tensor | None = None
    v_cache: Tensor | None = None


def _launch(
    positions: Tensor,
    inv_freq: Tensor,
    eps: float,
    out_slots: Tensor,
    q: _Rotated | None = None,
    index_q: _Rotated | None = None,
    kv: _Cached | None = None,
    index_k: _Cached | None = None,
) -> None:
    """One launch for every part given: a program per token and block of heads."""
    heads = [(p.x if isinstance(p, _Rotated) else p.k) for p in (q, index_q, kv, index_k) if p]
    t = heads[0].shape[0]
    if t == 0:
        return
    main = q.x if q else kv.k if kv else heads[0]
    index = index_q.x if index_q else index_k.k if index_k else heads[0]
    d, di = main.shape[-1], index.shape[-1]
    block_d, block_di = triton.next_power_of_2(d), triton.next_power_of_2(di)
    hold = positions  # the placeholder pointer of an absent part (its branch never runs)

    def rotated(part: _Rotated | None, block_d: int) -> tuple[list, int, int]:
        if part is None:
            return [hold, 0, 0, hold, 0, 0, hold, 0], 0, 1
        x, out = part.x, part.out
        h = x.shape[1]
        block_h = _block_h(h, block_d)
        args = [x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1), part.weight, h]
        return args, triton.cdiv(h, block_h), block_h

    q_args, q_blocks, block_hq = rotated(q, block_d)
    iq_args, iq_blocks, block_hiq = rotated(index_q, block_di)
    if kv is None:
        kv_args, kv_blocks, block_hkv = [hold, 0, 0, hold, hold, 0, 0] + [hold, 0, 0] * 2, 0, 1
        kv_heads, fp8 = 0, False
    else:
        k, cache, kv_heads = kv.k, kv.cache, kv.k.shape[1]
        block_hkv = _block_h(kv_heads, block_d)
        kv_blocks = triton.cdiv(kv_heads, block_hkv)
        v = kv.v if kv.v is not None else k
        v_cache = kv.v_cache if kv.v_cache is not None else cache
        kv_args = [k, k.stride(0), k.stride(1), kv.weight, cache, cache.stride(0), cache.stride(1)]
        kv_args += [v, v.stride(0), v.stride(1), v_cache, v_cache.stride(0), v_cache.stride(1)]
        fp8 = _cache_fp8(cache, "k_cache")
    if index_k is None:
        ik_args, ik_fp8 = [hold, 0, hold, hold, 0], False
    else:
        ik, ik_cache = index_k.k, index_k.cache
        ik_args = [ik, ik.stride(0), index_k.weight, ik_cache, ik_cache.stride(0)]
        ik_fp8 = _cache_fp8(ik_cache, "index_k_cache")
    grid = (t, q_blocks + iq_blocks + kv_blocks + (index_k is not None))
    _heads_kernel[grid](
        positions, inv_freq, out_slots, eps, *q_args, *iq_args, *kv_args, kv_heads, *ik_args,
        D=d, DI=di, HALF=inv_freq.numel(), BLOCK_D=block_d, BLOCK_DI=block_di,
        Q_BLOCKS=q_blocks, BLOCK_HQ=block_hq, IQ_BLOCKS=iq_blocks, BLOCK_HIQ=block_hiq,
        KV_BLOCKS=kv_blocks, BLOCK_HKV=block_hkv, HAS_V=kv is not None and kv.v is not None,
        FP8=fp8, IK=index_k is not None, IK_FP8=ik_fp8, num_warps=4,
    )  # fmt: skip


def norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """Per-head Gemma RMSNorm then partial NeoX RoPE of x [T, H, D]; result in x's dtype.

    weight: [D]; positions: [T] int; inv_freq: [rotary_dim / 2] fp32. `out` ([T, H, D], x's
    dtype, last dim contiguous) receives the result when given.
    """
    out = _rotated_out(x, weight, positions, inv_freq, out, "x")
    if x.shape[1]:
        _launch(positions, inv_freq, eps, positions, q=_Rotated(x, weight, out))
    return out


def _rotated_out(
    x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor, out: Tensor | None, name: str
) -> Tensor:
    """Check a part that norm_rope returns; its output buffer."""
    _heads_view_ok(x, name, 3)
    _rope_args(x, weight, positions, inv_freq)
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"the output of {name} must have its shape, dtype and device")
    _heads_view_ok(out, "out", 3)
    return out


def _cache_fp8(cache: Tensor, name: str) -> bool:
    if cache.dtype == torch.float8_e4m3fn:
        return True
    if not cache.dtype.is_floating_point or cache.element_size() < 2:
        raise ValueError(f"{name} dtype {cache.dtype} is not a supported cache dtype")
    return False


def _check_slots(out_slots: Tensor, t: int) -> None:
    if out_slots.shape != (t,) or out_slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"out_slots must be a [{t}] integer tensor")
    if not out_slots.is_contiguous():
        raise ValueError("out_slots must be contiguous")


def _checked_kv(
    k: Tensor,
    v: Tensor,
    k_weight: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    out_slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> _Cached:
    _heads_view_ok(k, "k", 3)
    _heads_view_ok(v, "v", 3)
    _heads_view_ok(k_cache, "k_cache", 3)
    _heads_view_ok(v_cache, "v_cache", 3)
    d, _, _ = _rope_args(k, weight=k_weight, positions=positions, inv_freq=inv_freq)
    h = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    if k_cache.shape[1:] != (h, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [slots, {h}, {d}] and alike")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")
    _check_slots(out_slots, k.shape[0])
    _cache_fp8(k_cache, "k_cache")
    return _Cached(k, k_weight, k_cache, v, v_cache)


def _checked_index_k(
    ik: Tensor,
    weight: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    out_slots: Tensor,
    index_k_cache: Tensor,
) -> _Cached:
    _heads_view_ok(ik, "ik", 2)
    _heads_view_ok(index_k_cache, "index_k_cache", 2)
    d, _, _ = _rope_args(ik, weight, positions, inv_freq)
    if index_k_cache.shape[1] != d:
        raise ValueError(f"index_k_cache must be [slots, {d}]")
    _check_slots(out_slots, ik.shape[0])
    _cache_fp8(index_k_cache, "index_k_cache")
    return _Cached(ik, weight, index_k_cache)


def norm_rope_write_kv(
    k: Tensor,
    v: Tensor,
    k_weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    out_slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> None:
    """Normalize and rotate k [T, Hkv, D], then write k and v [T, Hkv, D] to the caches
    ([slots, Hkv, D]) at out_slots [T], cast to the cache dtype. Slots must be distinct."""
    kv = _checked_kv(k, v, k_weight, positions, inv_freq, out_slots, k_cache, v_cache)
    _launch(positions, inv_freq, eps, out_slots, kv=kv)


def norm_rope_write_index_k(
    ik: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    out_slots: Tensor,
    index_k_cache: Tensor,
) -> None:
    """Normalize and rotate the index key ik [T, Di] (one head), then write it to
    index_k_cache [slots, Di] at out_slots [T], cast to the cache dtype."""
    index_k = _checked_index_k(ik, weight, positions, inv_freq, out_slots, index_k_cache)
    _launch(positions, inv_freq, eps, out_slots, index_k=index_k)


def norm_rope_heads(
    q: Tensor,
    q_weight: Tensor,
    k: Tensor,
    v: Tensor,
    k_weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    out_slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    index: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A layer's attention inputs in one launch: `norm_rope` of q [T, H, D], `norm_rope_write_kv`
    of k and v, and with `index` = (index_q [T, Hi, Di], its norm weight, index_k [T, Di], its
    norm weight, index_k_cache [slots, Di]) `norm_rope` of index_q and `norm_rope_write_index_k`
    of index_k. Returns (q, index_q) normalized and rotated (index_q None without `index`)."""
    q_out = _rotated_out(q, q_weight, positions, inv_freq, None, "q")
    kv = _checked_kv(k, v, k_weight, positions, inv_freq, out_slots, k_cache, v_cache)
    if index is None:
        _launch(positions, inv_freq, eps, out_slots, q=_Rotated(q, q_weight, q_out), kv=kv)
        return q_out, None
    iq, iq_weight, ik, ik_weight, ik_cache = index
    iq_out = _rotated_out(iq, iq_weight, positions, inv_freq, None, "index_q")
    index_k = _checked_index_k(ik, ik_weight, positions, inv_freq, out_slots, ik_cache)
    _launch(
        positions, inv_freq, eps, out_slots, q=_Rotated(q, q_weight, q_out),
        index_q=_Rotated(iq, iq_weight, iq_out), kv=kv, index_k=index_k,
    )  # fmt: skip
    return q_out, iq_out
