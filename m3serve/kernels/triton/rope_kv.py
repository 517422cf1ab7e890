"""Per-head Gemma RMSNorm + partial NeoX RoPE in Triton, fused with the KV-cache writes.

Semantics are the reference backend's `head_norm_rope` and `store_kv`: each head vector is
normalized in fp32 and scaled by (1 + w); the first `rotary_dim` channels rotate in pairs
(i, i + rotary_dim/2) by the fp32 angle positions * inv_freq; the rest pass through; the
result is cast once to the input dtype. Cache writes then cast that result to the cache dtype
(bf16, or float8_e4m3fn with scale 1.0, saturating at +-448: what a plain torch cast does
past that differs between builds and devices, NaN on some).

One kernel, `heads_kernel`, for every projection family, alone or together:
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
from torch import Tensor

from m3serve.kernels.triton.rope_kv_kernels import heads_kernel

# Aim for ~2K elements per program: a [heads, head_dim] tile of 16 x 128 for the model.
_TILE_ELEMS = 2048


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
    heads_kernel[grid](
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
