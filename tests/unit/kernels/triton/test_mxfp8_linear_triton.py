"""Triton W8A16 MXFP8 linear (m3serve.kernels.triton.mxfp8_linear) against the fp32 reference.

Tiny shapes (K 64..128, N 16..96) so the file runs in seconds under TRITON_INTERPRET=1 on the CPU;
real shapes live in tests/gpu/test_mxfp8_linear_gpu.py. Explicit plans with 16-wide tiles reach
every path at these sizes: split-K (with a K tail inside the last split), several M and N tiles,
more M tiles than one tile group, tails of N and K that are not multiples of the blocks.

Tolerance: the dequantized weight is exact, and so are the products with the bf16 terms of x, so
the kernel and the reference differ only by the order of their fp32 sums and the one rounding of
the result to x's dtype. The bound is one ulp of that dtype at the reference value (the
interpreter truncates fp32 -> bf16 instead of rounding) plus 1e-5 of the row's largest value.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.kernels.linear import mxfp8_linear_reference
from m3serve.kernels.quant import dequant_mxfp8, quant_mxfp8
from m3serve.kernels.triton.mxfp8_linear import (
    COPY_MIN_M,
    DECODE_MAX_M,
    DEQUANT_MIN_M,
    GEMV_MAX_M,
    Mxfp8Plan,
    dequant_mxfp8_bf16,
    mxfp8_linear,
    plan_mxfp8,
    prepare_mxfp8,
)

H200_SMS = 132
# (N, K) of the model's MXFP8 projections: fused q/k/v/index-q/index-k, o_proj, shared-expert
# down, shared gate_up, dense gate_up, dense down.
MODEL_SHAPES = [
    (9856, 6144),
    (6144, 8192),
    (6144, 3072),
    (6144, 6144),
    (24576, 6144),
    (6144, 12288),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weight(n: int, k: int, seed: int, top: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 codes and scales of a weight whose 32-blocks span four decades of magnitude, up to
    10**top, so that neighbouring blocks of a row have different scale bytes."""
    g = gen(seed)
    magnitude = 10.0 ** torch.empty(n, k // 32, 1).uniform_(top - 4, top, generator=g)
    w = (torch.randn(n, k // 32, 32, generator=g) * magnitude).flatten(-2)
    return quant_mxfp8(w)


def activations(m: int, k: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(m, k, generator=gen(seed)) * scale).to(dtype)


def run(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    plan: Mxfp8Plan | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    dev = (x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE))
    return mxfp8_linear(*dev, out=out, plan=plan).cpu()


def assert_matches_reference(
    got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    ref = mxfp8_linear_reference(x, codes, scales)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN pattern differs"
    g, r = got.float().nan_to_num(), ref.nan_to_num()
    tiny = torch.finfo(torch.float32).tiny
    row = r.abs().amax(dim=1, keepdim=True)
    ulp = torch.finfo(x.dtype).eps * torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(tiny))))
    err = (g - r).abs()
    bad = err > ulp + 1e-5 * row
    assert not bad.any(), f"{int(bad.sum())} elements off: {g[bad][:4]} vs {r[bad][:4]}"


# ---------------------------------------------------------------------------- default plans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 17, 33, 70])
def test_default_plan_matches_reference(m: int, dtype: torch.dtype) -> None:
    # M 1 and 3 pad to a 16-row tile, 17 to 32, 33 to 64; 70 takes the prefill tiles. N = 96 is
    # one and a half 64-row decode tiles; K = 96 is not a multiple of the 128-wide K step.
    codes, scales = weight(96, 96, seed=m)
    x = activations(m, 96, dtype, seed=100 + m)
    assert_matches_reference(run(x, codes, scales), x, codes, scales)


def test_fp16_activations_are_split_exactly() -> None:
    # fp16 x = bf16 hi + bf16 remainder exactly: the products are those of the fp16 values.
    codes, scales = weight(48, 128, seed=2)
    x = activations(5, 128, torch.float16, seed=3, scale=30.0)
    assert_matches_reference(run(x, codes, scales), x, codes, scales)


def test_fp32_activations_keep_their_low_bits() -> None:
    # A bf16-only dot would be off by ~1e-3 here; the three-term split keeps fp32 accuracy.
    codes, scales = weight(32, 64, seed=4)
    x = activations(3, 64, torch.float32, seed=5) * (1 + 2.0**-12)
    got = run(x, codes, scales)
    ref = mxfp8_linear_reference(x, codes, scales)
    bf16_only = mxfp8_linear_reference(x.bfloat16(), codes, scales)
    assert (ref - bf16_only).abs().max() > 1e3 * (got - ref).abs().max()
    assert_matches_reference(got, x, codes, scales)


# ---------------------------------------------------------------------------- explicit plans


@pytest.mark.parametrize(
    ("m", "n", "k", "plan"),
    [
        # split-K over 3 programs of 2 K steps, the last ending in a 32-wide tail (K 160)
        (3, 40, 160, Mxfp8Plan(16, 16, 32, 3, 4, 2)),
        # 2 splits of 64-wide steps, K 96: the second split is a lone 32-wide masked step
        (17, 48, 96, Mxfp8Plan(16, 32, 64, 2, 4, 1)),
        # more splits requested than K steps: capped, no empty split
        (1, 16, 64, Mxfp8Plan(16, 16, 32, 8, 4, 1)),
        # large-M path on small tiles: 5 M tiles x 3 N tiles, N tail 8 rows
        (70, 40, 64, Mxfp8Plan(16, 16, 64, 1, 4, 2)),
        # 17 M tiles: one full group of 16 M tiles and a partial one, with split-K on top
        (272, 32, 64, Mxfp8Plan(16, 16, 32, 2, 4, 1)),
    ],
    ids=["split3-ktail", "split2-mtiles", "split-capped", "prefill-tiles", "groups-split"],
)
def test_explicit_plans_match_reference(m: int, n: int, k: int, plan: Mxfp8Plan) -> None:
    codes, scales = weight(n, k, seed=n + k)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(m, k, dtype, seed=m)
        assert_matches_reference(run(x, codes, scales, plan), x, codes, scales)


def test_split_k_is_deterministic_and_equals_the_direct_path_up_to_sum_order() -> None:
    codes, scales = weight(32, 128, seed=6)
    x = activations(4, 128, torch.float32, seed=7)
    split = Mxfp8Plan(16, 16, 32, 4, 4, 1)
    first, second = run(x, codes, scales, split), run(x, codes, scales, split)
    assert torch.equal(first, second)
    direct = run(x, codes, scales, Mxfp8Plan(16, 16, 32, 1, 4, 1))
    torch.testing.assert_close(first, direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("split", [1, 3], ids=["direct", "split3"])
def test_scale_word_loads_match_reference(split: int, words: bool) -> None:
    """K steps of 128 (the decode tiles) load a row's four scale bytes as one aligned load
    (bytes said to start on a word, or one int32 word), also in each split; every 32-block of
    these rows has its own scale byte, and bytes past 127 (a word's sign bit included)."""
    codes, scales = weight(40, 384, seed=21, top=3.0)
    assert len(set(scales[0].tolist())) > 4 and (scales[:, 3::4] > 127).any()
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(3, 384, dtype, seed=22)
        got = run(x, codes, scales, Mxfp8Plan(16, 16, 128, split, 4, 2, scale_words=words))
        assert_matches_reference(got, x, codes, scales)


def test_the_m_tile_32_plan_loads_scale_words_and_a_misaligned_scale_tensor_bytes() -> None:
    """M 17-32 takes the 64-row tiles, which load words; scales that do not start on a word
    (a view one byte in) take the byte loads instead, with the same result."""
    codes, scales = weight(96, 384, seed=23)
    x = activations(20, 384, torch.bfloat16, seed=24)
    assert plan_mxfp8(20, 96, 384, 1).scale_words
    assert_matches_reference(run(x, codes, scales), x, codes, scales)
    buffer = torch.empty(scales.numel() + 1, dtype=torch.uint8, device=DEVICE)
    shifted = buffer[1:].view(scales.shape)
    shifted.copy_(scales)
    got = mxfp8_linear(x.to(DEVICE), codes.to(DEVICE), shifted).cpu()
    assert_matches_reference(got, x, codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_prefill_tile_loads_scale_words_at_k_steps_of_128(dtype: torch.dtype) -> None:
    """Past one decode tile (70 rows) the 128-row tiles step K by 128 and load each row's four
    scales as one word: two K steps, the second split off, match the reference."""
    codes, scales = weight(96, 256, seed=25)
    x = activations(70, 256, dtype, seed=26)
    p = plan_mxfp8(70, 96, 256, 1)
    assert (p.block_m, p.block_k, p.scale_words, p.dequant) == (128, 128, True, False)
    assert_matches_reference(run(x, codes, scales, p), x, codes, scales)
    split = dataclasses.replace(p, split_k=2)
    assert_matches_reference(run(x, codes, scales, split), x, codes, scales)


def test_a_held_bf16_copy_replaces_the_per_call_dequantization_bit_for_bit() -> None:
    """`--mxfp8-bf16-copy`: rows that take the dequantized path multiply the held copy, with the
    same bits as dequantizing per call; fewer rows keep reading the codes (a copy of zeros
    there changes nothing)."""
    codes, scales = weight(96, 256, seed=27)
    held = dequant_mxfp8_bf16(codes.to(DEVICE), scales.to(DEVICE))
    x = activations(DEQUANT_MIN_M + 3, 256, torch.bfloat16, seed=28)
    dev = (x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE))
    assert plan_mxfp8(x.shape[0], 96, 256, 1).dequant
    assert torch.equal(mxfp8_linear(*dev, bf16=held), mxfp8_linear(*dev))
    zeros = torch.zeros_like(held)
    decode = (dev[0][:DECODE_MAX_M], *dev[1:])
    assert torch.equal(mxfp8_linear(*decode, bf16=zeros), mxfp8_linear(*decode))
    with pytest.raises(ValueError, match="bf16: expected W"):
        mxfp8_linear(*dev, bf16=held[:, :128])


def test_a_held_bf16_copy_is_read_from_the_first_row_past_the_decode_tiles() -> None:
    """Between the decode tiles and DEQUANT_MIN_M the codes take the 128-row MMA tile, but with
    a copy held cuBLAS reads it (no conversion left to amortize): its bits, not the tile's."""
    codes, scales = weight(96, 256, seed=29)
    held = dequant_mxfp8_bf16(codes.to(DEVICE), scales.to(DEVICE))
    x = activations(COPY_MIN_M, 256, torch.bfloat16, seed=30).to(DEVICE)
    assert COPY_MIN_M == DECODE_MAX_M + 1 < DEQUANT_MIN_M
    assert not plan_mxfp8(COPY_MIN_M, 96, 256, 1).dequant  # without a copy: the MMA tile
    got = mxfp8_linear(x, codes.to(DEVICE), scales.to(DEVICE), bf16=held)
    assert torch.equal(got, torch.nn.functional.linear(x, held))
    zeros = torch.zeros_like(held)
    assert not mxfp8_linear(x, codes.to(DEVICE), scales.to(DEVICE), bf16=zeros).any()


# ------------------------------------------------------------------------------ edge scales


def edge_weight(
    n: int, k: int, bytes_: list[int], seed: int, min_code: float, max_code: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes with |code| in [min_code, max_code] and scale bytes drawn from `bytes_`."""
    g = gen(seed)
    mag = torch.empty(n, k).uniform_(min_code, max_code, generator=g)
    sign = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    codes = (mag * sign).to(torch.float8_e4m3fn)
    pick = torch.randint(0, len(bytes_), (n, k // 32), generator=g)
    return codes, torch.tensor(bytes_, dtype=torch.uint8)[pick]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scale_bytes_near_254(dtype: torch.dtype) -> None:
    # W up to 1.75 * 2**127 (codes below 2 keep it finite, as float32 and bf16 must); x of
    # 2**-100 keeps the sums finite, and its split terms (down to ~2**-118) normal.
    codes, scales = edge_weight(32, 96, [250, 252, 253, 254], seed=8, min_code=0.0, max_code=1.75)
    x = activations(3, 96, dtype, seed=9, scale=2.0**-100)
    got = run(x, codes, scales, Mxfp8Plan(16, 16, 32, 2, 4, 1))
    assert torch.isfinite(got).all()
    assert_matches_reference(got, x, codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scale_bytes_near_0(dtype: torch.dtype) -> None:
    # Byte 0 is 2**-127, below float32's normal range: the kernel must build it from its bits.
    # Codes of magnitude >= 2 keep every W normal (>= 2**-126), where bf16 holds it exactly
    # (a subnormal W is outside that claim, and the interpreter's dot flushes subnormals);
    # x of 2**110 brings y to normal range.
    codes, scales = edge_weight(32, 96, [0, 1, 2, 3], seed=10, min_code=2.0, max_code=448.0)
    x = activations(3, 96, dtype, seed=11, scale=2.0**110)
    got = run(x, codes, scales)
    assert (got != 0).all()
    assert_matches_reference(got, x, codes, scales)


def test_zero_blocks_next_to_live_ones() -> None:
    # quant_mxfp8 encodes an all-zero block as byte 0 with zero codes: it adds exactly 0.
    w = torch.randn(24, 128, generator=gen(12))
    w.view(24, 4, 32)[::2, 1] = 0.0
    w[5] = 0.0  # a whole zero row: its output column is exactly zero
    codes, scales = quant_mxfp8(w)
    assert (scales == 0).sum() >= 13
    x = activations(3, 128, torch.float32, seed=13)
    got = run(x, codes, scales, Mxfp8Plan(16, 16, 64, 2, 4, 1))
    assert torch.equal(got[:, 5], torch.zeros(3))
    assert_matches_reference(got, x, codes, scales)


def test_nan_scale_byte_poisons_its_output_column_like_the_reference() -> None:
    codes, scales = weight(16, 64, seed=14)
    scales[3, 1] = 255  # E8M0 NaN
    x = activations(2, 64, torch.float32, seed=15)
    got = run(x, codes, scales)
    assert torch.isnan(got[:, 3]).all() and not torch.isnan(got[:, [0, 1, 2, 4]]).any()
    assert_matches_reference(got, x, codes, scales)


def test_k_tail_reads_nothing_past_the_row() -> None:
    # K 96 in 64-wide steps: the second step's lanes 96..127 would read the next row's first
    # codes and scale byte. Row 4 starts with NaN codes under a NaN scale; only its own output
    # column may be NaN. (The interpreter decodes the e4m3fn NaN byte as 480, which the zeroed x
    # lanes cancel: there only the scale byte would leak; on the GPU both would.)
    codes, scales = weight(16, 96, seed=21)
    codes.view(torch.uint8)[4, :32] = 0x7F  # e4m3fn NaN
    scales[4, 0] = 255
    x = activations(3, 96, torch.float32, seed=22)
    got = run(x, codes, scales, Mxfp8Plan(16, 16, 64, 1, 4, 1))
    assert torch.isnan(got[:, 4]).all() and not torch.isnan(got[:, [3, 5]]).any()
    assert_matches_reference(got, x, codes, scales)


# ----------------------------------------------------------------------- strides and buffers


def test_out_buffer_and_strided_operands() -> None:
    codes, scales = weight(40, 64, seed=16)
    wide = activations(5, 96, torch.bfloat16, seed=17)
    x = wide[:, 16:80]  # rows 96 apart
    buf = torch.full((5, 56), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = buf[:, 8:48]
    got = mxfp8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), out=out)
    assert got is out
    assert torch.isnan(buf[:, :8]).all() and torch.isnan(buf[:, 48:]).all()
    assert_matches_reference(out.cpu(), x, codes, scales)
    # A column-major x and a transposed out ([M, N] view of an [N, M] buffer) work too.
    xt = x.t().contiguous().t()
    out_t = torch.empty(40, 5, dtype=torch.bfloat16, device=DEVICE).t()
    mxfp8_linear(xt.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), out=out_t)
    assert_matches_reference(out_t.cpu(), x, codes, scales)


def test_leading_dims_flatten_like_torch_linear() -> None:
    codes, scales = weight(24, 64, seed=23)
    x = activations(6, 64, torch.float32, seed=24)
    got = mxfp8_linear(x.view(2, 3, 64).to(DEVICE), codes.to(DEVICE), scales.to(DEVICE)).cpu()
    assert got.shape == (2, 3, 24)
    assert_matches_reference(got.view(6, 24), x, codes, scales)
    out = torch.empty(2, 3, 24, device=DEVICE)
    assert (
        mxfp8_linear(x.view(2, 3, 64).to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), out) is out
    )
    assert torch.equal(out.cpu(), got)


def test_empty_batch_returns_an_empty_result() -> None:
    codes, scales = weight(16, 64, seed=18)
    got = run(torch.empty(0, 64), codes, scales)
    assert got.shape == (0, 16)


def test_prepare_keeps_the_checkpoint_layout() -> None:
    codes, scales = weight(16, 64, seed=19)
    same = prepare_mxfp8(codes, scales)
    assert same[0] is codes and same[1] is scales
    wide_c = torch.zeros(16, 128, dtype=torch.uint8)
    wide_c[:, :64] = codes.view(torch.uint8)
    strided = wide_c[:, :64].view(torch.float8_e4m3fn)
    wide_s = torch.zeros(16, 4, dtype=torch.uint8)
    wide_s[:, :2] = scales
    c2, s2 = prepare_mxfp8(strided, wide_s[:, :2])
    assert c2.is_contiguous() and s2.is_contiguous()
    assert torch.equal(c2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s2, scales)


def test_rejects_bad_inputs() -> None:
    codes, scales = weight(16, 64, seed=20)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="codes"):
        mxfp8_linear(x, codes.view(torch.uint8), scales)
    with pytest.raises(ValueError, match="scales"):
        mxfp8_linear(x, codes, scales[:, :1])
    with pytest.raises(ValueError, match="x"):
        mxfp8_linear(torch.randn(2, 32), codes, scales)
    with pytest.raises(ValueError, match="x"):
        mxfp8_linear(x.to(torch.int32), codes, scales)
    with pytest.raises(ValueError, match="out"):
        mxfp8_linear(x, codes, scales, out=torch.empty(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        k_strided = codes.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn)
        mxfp8_linear(x, k_strided, scales)
    with pytest.raises(ValueError, match="plan"):
        mxfp8_linear(x, codes, scales, plan=Mxfp8Plan(16, 16, 48, 1, 4, 1))
    with pytest.raises(ValueError, match="scale words"):
        mxfp8_linear(x, codes, scales, plan=Mxfp8Plan(16, 16, 64, 1, 4, 1, scale_words=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "m, n, k, plan",
    [
        (4, 40, 96, Mxfp8Plan(4, 16, 64, 1, 4, 2, gemv=True)),  # K = 96: a masked K step
        (3, 33, 256, Mxfp8Plan(4, 8, 64, 3, 4, 2, gemv=True)),  # split K, N not a tile multiple
        (9, 16, 128, Mxfp8Plan(16, 16, 32, 1, 4, 1, gemv=True)),  # an explicit plan past 4 rows
    ],
    ids=["masked-k", "split-k", "sixteen-rows"],
)
def test_gemv_plans_match_reference(
    m: int, n: int, k: int, plan: Mxfp8Plan, dtype: torch.dtype
) -> None:
    codes, scales = weight(n, k, seed=n + k)
    x = activations(m, k, dtype, seed=m)
    assert_matches_reference(run(x, codes, scales, plan=plan), x, codes, scales)


def test_gemv_writes_a_strided_out() -> None:
    codes, scales = weight(48, 128, seed=8)
    x = activations(2, 128, torch.float32, seed=9)
    fused = torch.zeros(2, 80, device=DEVICE)
    run(x, codes, scales, out=fused[:, 16:64])
    assert_matches_reference(fused[:, 16:64].cpu(), x, codes, scales)
    assert not fused[:, :16].any() and not fused[:, 64:].any()


def test_gemv_refuses_more_rows_than_its_plan_takes() -> None:
    codes, scales = weight(16, 64, seed=1)
    x = activations(17, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 16 rows"):
        run(x, codes, scales, plan=Mxfp8Plan(32, 16, 64, 1, 4, 1, gemv=True))


# ----------------------------------------------------------------------- the dequantized path


def test_whole_weight_dequantization_is_exact() -> None:
    # N and K tails past the kernel's 32 x 256 blocks; scales spanning four decades.
    codes, scales = weight(45, 288, seed=40)
    got = dequant_mxfp8_bf16(codes.to(DEVICE), scales.to(DEVICE)).cpu()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequant_mxfp8(codes, scales).to(torch.bfloat16))


def test_bf16_rows_from_the_crossover_take_cublas_and_match_reference() -> None:
    codes, scales = weight(40, 96, seed=41)
    x = activations(DEQUANT_MIN_M + 3, 96, torch.bfloat16, seed=42)
    assert plan_mxfp8(x.shape[0], 40, 96, H200_SMS).dequant
    assert_matches_reference(run(x, codes, scales), x, codes, scales)
    # A column slice of a fused buffer as out: cuBLAS writes dense rows, copied in.
    buf = torch.full((x.shape[0], 56), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mxfp8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), out=buf[:, 8:48])
    assert torch.isnan(buf[:, :8]).all() and torch.isnan(buf[:, 48:]).all()
    assert_matches_reference(buf[:, 8:48].cpu(), x, codes, scales)


def test_fp32_rows_past_the_crossover_keep_the_exact_tiles() -> None:
    # The dequantized path is bf16 only: fp32 x keeps all 24 bits through the MMA tiles.
    codes, scales = weight(24, 64, seed=43)
    x = activations(DEQUANT_MIN_M + 1, 64, torch.float32, seed=44)
    assert_matches_reference(run(x, codes, scales), x, codes, scales)


# ------------------------------------------------------------------------------ the heuristic


def test_decode_plans_read_the_weight_once_and_fill_the_gpu() -> None:
    for n, k in MODEL_SHAPES:
        for m in range(1, DECODE_MAX_M + 1):
            p = plan_mxfp8(m, n, k, H200_SMS)
            # One M tile (the MMA path) or every row in each program (GEMV): weights read once.
            assert p.block_m >= m and p.block_m in ((1, 2, 4) if p.gemv else (16, 32, 64))
            assert p.gemv == (m <= GEMV_MAX_M) and not p.dequant
            tiles = -(-n // p.block_n)
            steps = -(-k // p.block_k)
            assert p.split_k <= steps
            assert tiles * p.split_k >= H200_SMS, (m, n, k, p)
            assert k % p.block_k == 0  # the unmasked (EVEN_K) variant on every model shape
            # Words where the H200 measured them faster: the M-tile-32 and M-tile-64 tiles.
            assert p.scale_words == (p.block_m in (32, 64) and not p.gemv)


def test_compiled_variants_stay_few() -> None:
    """(tile config, direct or split) over every model shape, M 1..64, 128, 257 and 2048."""
    ms = [*range(1, DECODE_MAX_M + 1), 128, 257, 2048, 8192]
    variants = set()
    for n, k in MODEL_SHAPES:
        for m in ms:
            p = plan_mxfp8(m, n, k, H200_SMS)
            variants.add(
                (p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages, p.split_k == 1)
            )
    # GEMV: one per padded M (1, 2, 4); MMA: 3 decode tiles + prefill, each direct or split.
    assert len(variants) <= 12, sorted(variants)
    big = plan_mxfp8(2048, 6144, 6144, H200_SMS)
    assert big.block_m == 128 and big.split_k == 1
