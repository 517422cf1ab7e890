"""Triton per-head norm + partial RoPE (+ KV / index-K cache writes) against the reference
backend's `head_norm_rope` and `store_kv`.

Shapes are tiny (H 4, Hkv 2, D 16, rotary 8, page 4) so the CPU interpreter stays fast.
Positions are large and out of order so the angles need real range reduction; slots are
shuffled; caches start as NaN so a stray or missing write shows.

The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even, so bf16
results are held to one bf16 ulp; fp8 rounding is done in-kernel and checked bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.backends.reference import ReferenceBackend
from m3serve.kernels.rope import rope_inv_freq
from m3serve.kernels.triton.rope_kv import (
    norm_rope,
    norm_rope_heads,
    norm_rope_write_index_k,
    norm_rope_write_kv,
)
from m3serve.model.kv_cache import LayerKV

EPS = 1e-6
THETA = 5_000_000.0
T, H, HKV, D, ROT, PAGE, PAGES = 8, 4, 2, 16, 8, 4, 16
FP8 = torch.float8_e4m3fn
POSITIONS = [100_000, 7, 3, 99_999, 123_456, 0, 65_535, 31]

REF = ReferenceBackend(DEVICE)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def positions() -> torch.Tensor:
    return torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)


def shuffled_slots(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(PAGES * PAGE, generator=g)[:T].to(DEVICE)


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8:  # 0x7f is e4m3fn NaN; built as bytes, fp8 fills are not everywhere
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache cast the kernels implement: fp8 saturates at +-448 (scale 1.0)."""
    return x.clamp(-448.0, 448.0).to(dtype) if dtype == FP8 else x.to(dtype)


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of `dtype` at each (fp32) reference value, subnormal quantum included."""
    fi = torch.finfo(dtype)
    exp = torch.floor(torch.log2(ref.abs().clamp_min(fi.tiny)))
    return fi.eps * torch.exp2(exp)


def assert_close_in(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: fp32 rounding. bf16 / fp8: at most one ulp of that format apart."""
    g, r = got.float(), ref.float()
    assert torch.isfinite(g).all() and torch.isfinite(r).all()
    if dtype == torch.float32:
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        return
    bad = (g - r).abs() > ulp(r, dtype)
    assert not bad.any(), f"{int(bad.sum())} beyond one ulp: {g[bad][:4]} vs {r[bad][:4]}"


def poisoned_layer(dtype: torch.dtype) -> LayerKV:
    n = PAGES * PAGE
    return LayerKV(
        k=poisoned(n, HKV, D, dtype=dtype),
        v=poisoned(n, HKV, D, dtype=dtype),
        index_k=poisoned(n, D, dtype=dtype),
    )


def raw(x: torch.Tensor) -> torch.Tensor:
    """The bits of x (fp8 tensors compare and index most reliably as bytes)."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return raw(cache)[slots].view(cache.dtype)


def assert_only_slots_written(cache: torch.Tensor, slots: torch.Tensor) -> None:
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    untouched[slots] = False
    rest = raw(cache)[untouched]
    assert (rest == 0x7F).all() if cache.dtype == FP8 else rest.isnan().all()


# ------------------------------------------------------------------------------ norm_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "rot"), [(H, ROT), (3, D)])
def test_norm_rope_matches_reference(dtype: torch.dtype, heads: int, rot: int) -> None:
    # 3 heads exercise the head mask; rot == D is a full (non-partial) rotation.
    x = randn(T, heads, D, seed=1, scale=3.0).to(dtype)
    w = randn(D, seed=2, scale=0.5)
    inv_freq = rope_inv_freq(rot, THETA, DEVICE)
    got = norm_rope(x, w, EPS, positions(), inv_freq)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close_in(got, REF.head_norm_rope(x, w, EPS, positions(), inv_freq), dtype)


def test_norm_rope_strided_input_out_buffer_and_int32_positions() -> None:
    # q as it comes out of a fused projection: a column slice with a wider row stride.
    fused = randn(T, (H + 2) * D, seed=3, scale=2.0)
    x = fused[:, D : (H + 1) * D].view(T, H, D)
    assert not x.is_contiguous()
    w = randn(D, seed=4, scale=0.5)
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    out = torch.full((T, H, D), float("nan"), device=DEVICE)
    got = norm_rope(x, w, EPS, positions().int(), inv_freq, out=out)
    assert got is out
    assert_close_in(out, REF.head_norm_rope(x, w, EPS, positions(), inv_freq), torch.float32)


def test_norm_rope_leaves_channels_past_rotary_dim_unrotated() -> None:
    x = randn(T, H, D, seed=5)
    w = randn(D, seed=6, scale=0.5)
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    got = norm_rope(x, w, EPS, positions(), inv_freq)
    at_zero = norm_rope(x, w, EPS, torch.zeros_like(positions()), inv_freq)
    torch.testing.assert_close(got[..., ROT:], at_zero[..., ROT:], rtol=0, atol=0)
    assert not torch.allclose(got[..., :ROT], at_zero[..., :ROT])


# ----------------------------------------------------------------------- cache writes

# (activation dtype, cache dtype): the CPU tiny model, bf16 serving, bf16 serving + fp8 KV.
COMBOS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, FP8),
    (torch.float32, FP8),
]


@pytest.mark.parametrize(("act", "cache"), COMBOS)
def test_write_kv_and_index_k_match_reference(act: torch.dtype, cache: torch.dtype) -> None:
    # k and v as column slices of one fused projection output (row stride 2 * Hkv * D).
    kv = randn(T, 2 * HKV * D, seed=7, scale=3.0).to(act)
    k = kv[:, : HKV * D].view(T, HKV, D)
    v = kv[:, HKV * D :].view(T, HKV, D)
    ik = randn(T, D, seed=8, scale=3.0).to(act)
    k_norm = randn(D, seed=9, scale=0.5).to(act)
    ik_norm = randn(D, seed=10, scale=0.5).to(act)
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    slots = shuffled_slots(seed=11)

    # The reference writes into fp32 caches, which hold its k (already rounded to k's dtype)
    # exactly; the cache cast is then applied here, with the saturation the kernels promise
    # (what a plain fp8 cast does past 448 differs between torch versions and devices).
    ref = poisoned_layer(torch.float32)
    batch = SimpleNamespace(positions=positions(), out_slots=slots)
    REF.store_kv(ref, batch, k, v, k_norm, ik, ik_norm, EPS, inv_freq)  # type: ignore[arg-type]
    assert ref.index_k is not None
    ref_k, ref_v, ref_ik = (to_cache(c[slots], cache) for c in (ref.k, ref.v, ref.index_k))

    layer = poisoned_layer(cache)
    kc, vc, ic = layer.k, layer.v, layer.index_k
    assert ic is not None
    norm_rope_write_kv(k, v, k_norm, EPS, positions(), inv_freq, slots, kc, vc)
    norm_rope_write_index_k(ik, ik_norm, EPS, positions(), inv_freq, slots, ic)

    for got in (kc, vc, ic):
        assert_only_slots_written(got, slots)
    assert_close_in(gather(kc, slots), ref_k, cache)
    assert_close_in(gather(ic, slots), ref_ik, cache)
    # v is a pure cast; rounding to nearest even must agree with torch bit for bit.
    assert torch.equal(raw(gather(vc, slots)), raw(ref_v))


@pytest.mark.parametrize("indexer", [True, False], ids=["sparse", "full"])
@pytest.mark.parametrize(("act", "cache"), [(torch.float32, FP8), (torch.bfloat16, torch.bfloat16)])
def test_one_launch_does_what_the_separate_calls_do(
    indexer: bool, act: torch.dtype, cache: torch.dtype
) -> None:
    # A fused projection's output: q (H heads), k, v (HKV), index q (3 heads), index k.
    fused = randn(T, (H + 2 * HKV + 3 + 1) * D, seed=20, scale=3.0).to(act)
    q, k, v, iq, ik = fused.split([H * D, HKV * D, HKV * D, 3 * D, D], dim=1)
    q, k, v, iq = q.view(T, H, D), k.view(T, HKV, D), v.view(T, HKV, D), iq.view(T, 3, D)
    norms = [randn(D, seed=21 + i, scale=0.5).to(act) for i in range(4)]
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    slots = shuffled_slots(seed=25)

    apart, together = poisoned_layer(cache), poisoned_layer(cache)
    assert apart.index_k is not None and together.index_k is not None
    want_q = norm_rope(q, norms[0], EPS, positions(), inv_freq)
    want_iq = norm_rope(iq, norms[2], EPS, positions(), inv_freq)
    norm_rope_write_kv(k, v, norms[1], EPS, positions(), inv_freq, slots, apart.k, apart.v)
    if indexer:
        norm_rope_write_index_k(ik, norms[3], EPS, positions(), inv_freq, slots, apart.index_k)

    index = (iq, norms[2], ik, norms[3], together.index_k) if indexer else None
    got_q, got_iq = norm_rope_heads(
        q, norms[0], k, v, norms[1], EPS, positions(), inv_freq, slots, together.k, together.v,
        index,
    )  # fmt: skip
    assert torch.equal(got_q, want_q)
    assert (got_iq is not None) == indexer
    if got_iq is not None:
        assert torch.equal(got_iq, want_iq)
    # Byte for byte: the unwritten slots hold NaN, which never equals itself.
    for name in ("k", "v", "index_k"):  # index_k: untouched by both without the indexer
        mine, theirs = getattr(together, name), getattr(apart, name)
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name


def e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), a little either side
    of each midpoint, and values past the +-448 saturation point; both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    nudge = 1 + 2.0**-20
    over = torch.tensor([448.5, 463.9, 464.0, 479.0, 480.0, 1e4, float("inf")])
    pos = torch.cat([codes, mids, mids * nudge, mids / nudge, over])
    vals = torch.cat([pos, -pos])
    return torch.cat([vals, torch.zeros((-vals.numel()) % (T * HKV * D))])


def test_fp8_cache_rounds_to_nearest_even_and_saturates() -> None:
    vals = e4m3_probe_values()
    slots = shuffled_slots(seed=12)
    cache_slots = PAGES * PAGE
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    w = randn(D, seed=13, scale=0.5)
    for chunk in vals.split(T * HKV * D):
        v = chunk.view(T, HKV, D).to(DEVICE)
        k = randn(T, HKV, D, seed=14)
        kc = poisoned(cache_slots, HKV, D, dtype=FP8)
        vc = poisoned(cache_slots, HKV, D, dtype=FP8)
        norm_rope_write_kv(k, v, w, EPS, positions(), inv_freq, slots, kc, vc)
        want = to_cache(v, FP8)
        got = gather(vc, slots)
        diff = raw(got) != raw(want)
        assert not diff.any(), f"{v[diff][:4]} -> {got[diff][:4].float()}, want {want[diff][:4]}"


def test_rejects_bad_arguments() -> None:
    k = randn(T, HKV, D, seed=15)
    w = randn(D, seed=16)
    inv_freq = rope_inv_freq(ROT, THETA, DEVICE)
    cache = poisoned(PAGES * PAGE, HKV, D, dtype=torch.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        norm_rope(k, w, EPS, positions(), rope_inv_freq(2 * D, THETA, DEVICE))
    pos, slots = positions(), shuffled_slots(seed=1)
    with pytest.raises(ValueError, match="caches"):
        norm_rope_write_kv(k, k, w, EPS, pos, inv_freq, slots, cache, cache[:, :1])
    with pytest.raises(ValueError, match="out_slots"):
        norm_rope_write_kv(k, k, w, EPS, pos, inv_freq, slots[:2], cache, cache)
    bad = cache.to(torch.int8)
    with pytest.raises(ValueError, match="cache dtype"):
        norm_rope_write_kv(k, k, w, EPS, pos, inv_freq, slots, bad, bad)
