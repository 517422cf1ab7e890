"""The MXFP8 linear's Triton kernels: the MMA tile kernel (decode and prefill), the GEMV kernel
(M <= 2), the split-K reduction, and the whole-weight dequantization that feeds cuBLAS at larger M;
the tile math and the launch plans are described in `m3serve.kernels.triton.mxfp8_linear`, which
launches them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def mxfp8_mma_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_cn,
    stride_sn,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    X_TERMS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    SCALE_WORDS: tl.constexpr = False,
):
    if PDL:  # let the reduction kernel start launching; it waits for this grid on the device
        tl.extra.cuda.gdc_launch_dependents()
    # Grouped tile order: consecutive programs walk GROUP_M M tiles of one weight tile first.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows past N or M read a real row instead (results dropped at the store): the loads in the
    # K loop stay unmasked, so they vectorize and pipeline. Idle x rows wrap to rows 0, 1, ...:
    # read as row M - 1 each, they made the four projections of a layer take 168 µs at M 33 on
    # the 64-row tile against 128 at M 64 (likely every program's requests for them meeting at
    # the L2 slice of that one row); wrapped, 130 (masked loads: 138, but 147 at M 64 for their
    # per-copy predicates; an H100, 2026-12-06, perf/results/h100_2026-12-06i_overlap_rows/).
    rn_load = tl.minimum(rn, N - 1).to(tl.int64)
    rm_load = (rm % M).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, BLOCK_K // 32)
    c_ptrs = codes_ptr + rn_load[:, None] * stride_cn + (k_lo + rk)[None, :]
    s_first = k_lo // 32
    if BLOCK_K % 128 == 0:
        # k_lo is a multiple of BLOCK_K, so a K step's scales of a row start on a 4-byte word:
        # said so, a thread's 4 byte loads of a row become one 4-byte load, wide enough for an
        # asynchronous copy, which the pipeline issues ahead with the codes. Byte-wide they
        # stayed synchronous loads in the K loop, every step waiting out their latency (sm_90
        # SASS of the decode tiles: LDG.E.U8 and a trip through shared memory -> LDGSTS).
        s_first = tl.multiple_of(s_first, 4)
    s_ptrs = scales_ptr + rn_load[:, None] * stride_sn + (s_first + rg)[None, :]
    # SCALE_WORDS (K steps of 128, K a multiple of 128): each row's 4 scales of a step as one
    # little-endian word (byte j: group j). Where the byte layout gives a thread fewer than 4 of
    # them (64 rows at 4 warps: 2) they stay a synchronous load even aligned; which tiles take
    # words is measured (mxfp8_linear.py `DecodeTiles.words`).
    w_ptrs = scales_ptr.to(tl.pointer_type(tl.int32)) + rn_load * (stride_sn // 4) + k_lo // 128
    # x is loaded transposed ([BLOCK_K, BLOCK_M]): the dot's right operand.
    x_ptrs = x_ptr + rm_load[None, :] * stride_xm + (k_lo + rk)[:, None] * stride_xk

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_WORDS:
            codes = tl.load(c_ptrs)
            e = ((tl.load(w_ptrs)[:, None] >> (8 * rg)[None, :]) & 0xFF).to(tl.uint8)
            xt = tl.load(x_ptrs)
        elif EVEN_K:
            codes = tl.load(c_ptrs)
            e = tl.load(s_ptrs)
            xt = tl.load(x_ptrs)
        else:
            k_ok = (k0 + rk) < K
            # K is a multiple of 32: a scale group is either wholly inside K or wholly past it.
            codes = tl.load(c_ptrs, mask=k_ok[None, :], other=0.0)
            e = tl.load(s_ptrs, mask=((k0 // 32 + rg) < K // 32)[None, :], other=127)
            xt = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        scale = _e8m0_scale(e)
        w = tl.reshape(codes.to(tl.float32), [BLOCK_N, BLOCK_K // 32, 32]) * scale[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(tl.bfloat16).to(DOT_DTYPE)
        hi = xt.to(tl.bfloat16)
        acc = tl.dot(w, hi.to(DOT_DTYPE), acc, input_precision="ieee")
        if X_TERMS >= 2:
            rest = xt.to(tl.float32) - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            acc = tl.dot(w, mid.to(DOT_DTYPE), acc, input_precision="ieee")
            if X_TERMS >= 3:
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(w, lo.to(DOT_DTYPE), acc, input_precision="ieee")
        c_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // 32
        w_ptrs += 1
        x_ptrs += BLOCK_K * stride_xk

    _store_tile(acc, rn, rm, pid_k, M, N, out_ptr, part_ptr, stride_om, stride_on, DIRECT)


@triton.jit
def _store_tile(
    acc, rn, rm, pid_k, M, N, out_ptr, part_ptr, stride_om, stride_on, DIRECT: tl.constexpr
):
    """acc [rows rn, tokens rm] to out (cast to its dtype), or as split pid_k's fp32 partial."""
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    rn64 = rn.to(tl.int64)
    rm64 = rm.to(tl.int64)
    if DIRECT:
        o_ptrs = out_ptr + rm64[None, :] * stride_om + rn64[:, None] * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        p_ptrs = part_ptr + (pid_k.to(tl.int64) * M + rm64)[None, :] * N + rn64[:, None]
        tl.store(p_ptrs, acc, mask=ok)


@triton.jit
def _e8m0_scale(e):
    """2**(e - 127) for E8M0 bytes, as float32 bits (exact; 0 is 2**-127, 255 NaN)."""
    e = e.to(tl.int32)
    bits = e << 23
    bits = tl.where(e == 0, 1 << 22, bits)  # 2**-127 is below float32's normal range
    bits = tl.where(e == 255, 0x7FC00000, bits)  # E8M0 NaN
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def mxfp8_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_cn,
    stride_sn,
    stride_om,
    stride_on,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = tl.minimum(rn, N - 1).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, BLOCK_K // 32)
    rm = tl.arange(0, M_PAD)
    c_ptrs = codes_ptr + rn_load[:, None] * stride_cn + (k_lo + rk)[None, :]
    s_ptrs = scales_ptr + rn_load[:, None] * stride_sn + (k_lo // 32 + rg)[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            codes = tl.load(c_ptrs)
            e = tl.load(s_ptrs)
        else:
            codes = tl.load(c_ptrs, mask=((k0 + rk) < K)[None, :], other=0.0)
            e = tl.load(s_ptrs, mask=((k0 // 32 + rg) < K // 32)[None, :], other=127)
        scale = _e8m0_scale(e)
        w = codes.to(tl.float32)
        for m in tl.static_range(M_PAD):
            # Rows past M read row M - 1 again (dropped at the store): the loads stay unmasked.
            x_row = x_ptr + tl.minimum(m, M - 1).to(tl.int64) * stride_xm
            if EVEN_K:
                xm = tl.load(x_row + (k0 + rk) * stride_xk)
            else:
                xm = tl.load(x_row + (k0 + rk) * stride_xk, mask=(k0 + rk) < K, other=0.0)
            prod = tl.reshape(w * xm.to(tl.float32)[None, :], [BLOCK_N, BLOCK_K // 32, 32])
            part = tl.sum(tl.sum(prod, axis=2) * scale, axis=1)
            acc = tl.where(rm[None, :] == m, acc + part[:, None], acc)
        c_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // 32

    _store_tile(acc, rn, rm, pid_k, M, N, out_ptr, part_ptr, stride_om, stride_on, DIRECT)


@triton.jit(do_not_specialize=["M"])
def splitk_reduce_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    split,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (programmatic dependent launch): the partials are not written yet
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    ptrs = part_ptr + m * N + n
    split_stride = M.to(tl.int64) * N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Splits summed in index order: the result does not depend on which program finished first.
    for _ in range(split):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += split_stride
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mxfp8_dequant_kernel(
    codes_ptr,
    scales_ptr,
    w_ptr,
    N,
    K,
    stride_cn,
    stride_sn,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W [N, K] = codes x 2**(scale - 127), written in w's dtype (bf16: exact for normal W)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rg = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    rn64 = rn.to(tl.int64)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    codes = tl.load(codes_ptr + rn64[:, None] * stride_cn + rk[None, :], mask=ok, other=0.0)
    e = tl.load(
        scales_ptr + rn64[:, None] * stride_sn + rg[None, :],
        mask=(rn < N)[:, None] & (rg < K // 32)[None, :],
        other=127,
    )
    w = tl.reshape(codes.to(tl.float32), [BLOCK_N, BLOCK_K // 32, 32]) * _e8m0_scale(e)[:, :, None]
    w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    tl.store(w_ptr + rn64[:, None] * stride_wn + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)
