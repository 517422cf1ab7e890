"""Device helpers of the NVFP4 MoE kernels: E2M1 nibbles and e4m3 group scales to exact bf16
tiles (inline PTX on the GPU, plain Triton in the interpreter), the MMA K order, and the
W4A16 tile product with the exact split of fp32 activations."""

from __future__ import annotations

import triton
import triton.language as tl

# Decoded tiles carry e2m1 * scale * 2^-7 (see the module docstring); the accumulator undoes it.
TILE_SCALE = tl.constexpr(2.0**-7)
ACC_SCALE = tl.constexpr(2.0**7)
# The PTX decode is e2m1 * 2^-126; times scale * 2^(126 - 7) it is e2m1 * scale * 2^-7.
SCALE_BOOST = tl.constexpr(2.0**119)


# Values of the DEQUANT constexpr (the kernels compare against the literals).
DEQUANT_ASM = 0
DEQUANT_TRITON = 1


# Per byte of $4 (element j of the pack of 4): low nibble -> $0/$1, high nibble -> $2/$3 (bf16x2,
# bytes 0-1 then 2-3), each times its scale in $5/$6. prmt spreads bytes 0,1 (2,3) to the two
# halves; (nibble * (2^6 + 2^12)) & 0x81C0 puts magnitude bits at 6-8 and the sign at 15 (the two
# shifted copies do not overlap, so the multiply is an exact OR).
E2M1_PTX = tl.constexpr("""
{
.reg .b32 u, v, t;
prmt.b32 u, $4, 0, 0x4140;
prmt.b32 v, $4, 0, 0x4342;
and.b32 t, u, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
and.b32 t, v, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $6;
and.b32 t, u, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
and.b32 t, v, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, $6;
}
""")


@triton.jit
def _e2m1_value(code):
    """float32 value of 4-bit E2M1 codes (int32 tensor), exactly."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    # e >= 1: 2^(e-1) * (1 + m/2) == ((2 + m) << e) / 4; e == 0: m / 2 (the subnormal 0.5).
    normal = ((2 + m) << e).to(tl.float32) * 0.25
    value = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _group_scales(s, DEQUANT: tl.constexpr):
    """e4m3 group scales [R, G] -> the factor the decode multiplies by, before the broadcast to
    bytes (so each scale converts once): bf16 scale * 2^119 (asm) or fp32 scale * 2^-7."""
    if DEQUANT == 0:  # inline PTX
        out = (s.to(tl.float32) * SCALE_BOOST).to(tl.bfloat16)
    else:
        out = s.to(tl.float32) * TILE_SCALE
    return out


@triton.jit
def _dequant(b, s, DEQUANT: tl.constexpr, DOT: tl.constexpr):
    """Packed bytes b [R, C] uint8 and their `_group_scales` s [R, C] -> (even elements, odd
    elements) [R, C] in DOT, each e2m1 * scale * 2^-7 exactly."""
    if DEQUANT == 0:  # inline PTX
        lo, hi = tl.inline_asm_elementwise(
            asm=E2M1_PTX,
            constraints="=r,=r,=r,=r,r,r,r",
            args=[b, s],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        bi = b.to(tl.int32)
        lo = (_e2m1_value(bi & 15) * s).to(DOT)
        hi = (_e2m1_value(bi >> 4) * s).to(DOT)
    return lo, hi


@triton.jit
def _mma_k_order(t, R: tl.constexpr, C: tl.constexpr):
    """Reorder the C columns of t [R, C]: column j = (C/4)q + 4b + 2h + e goes to 16b + 8h + 2q + e.

    In the k16 MMA operand fragment, lane q of a quad holds columns 2q, 2q+1, 2q+8, 2q+9 of each
    16-column block; after this reorder those are C/4 consecutive source columns per thread, so
    the weight bytes come out of shared memory 16 at a time and no byte is shuffled between
    registers before the decode (checked in the sm_90 SASS). Applied to both operands of a dot it
    leaves the result unchanged.
    """
    t = tl.reshape(t, [R, 4, C // 16, 2, 2])
    t = tl.permute(t, (0, 2, 3, 1, 4))
    return tl.reshape(t, [R, C])


@triton.jit
def mma_k_position(j, TILE_K: tl.constexpr):
    """Where column j of the activations sits in the MMA K order the kernels read them in: in
    each TILE_K-wide tile the even columns, then the odd ones, each half in `_mma_k_order`'s
    order (the order the decoded weight tiles come in, so both operands of a dot agree)."""
    HALF: tl.constexpr = TILE_K // 2
    QUARTER: tl.constexpr = HALF // 4
    s = (j % TILE_K) // 2  # the column's place in its half
    q = s // QUARTER
    r = s % QUARTER  # 4b + 2h + e: it goes to 16b + 8h + 2q + e
    inside = 16 * (r // 4) + 8 * ((r // 2) % 2) + 2 * q + r % 2
    return (j // TILE_K) * TILE_K + (j % 2) * HALF + inside


@triton.jit
def mma_k_source(p, TILE_K: tl.constexpr):
    """The column of the activations that `mma_k_position` puts at position p: its inverse, so
    that a kernel can gather each output position's column and store its tile contiguously."""
    HALF: tl.constexpr = TILE_K // 2
    QUARTER: tl.constexpr = HALF // 4
    i = p % HALF  # 16b + 8h + 2q + e of the column's place 4b + 2h + e in quarter q of its half
    r = 4 * (i // 16) + 2 * ((i // 8) % 2) + i % 2
    q = (i // 2) % 4
    return (p // TILE_K) * TILE_K + 2 * (q * QUARTER + r) + (p % TILE_K) // HALF


@triton.jit
def nvfp4_mma(
    a_ptr,
    a_rows,
    a_ok,
    t_rows,
    t_ok,
    w_ptr,
    s_ptr,
    w_rows,
    w_ok,
    k_end,
    k_lo,
    k_hi,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    DEQUANT: tl.constexpr,
    DOT: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] fp32 = W[w_rows, k_lo:k_hi] @ A[a_rows, k_lo:k_hi]^T, W NVFP4
    (without its global scale, times 2^-7) in the row-tiled layout (`m3serve.kernels.
    nvfp4_tiles`: rows in groups of 32, each group's K in contiguous tiles; k_end is the whole
    K, which sets the layout's strides), A bf16 at element offsets a_rows (int64) from a_ptr,
    its columns in MMA K order (`mma_k_position`): each tile's two halves are the right operands
    of the even- and odd-element dots as they are in memory, so they go from the pipelined load
    to the tensor cores without a trip through registers. BLOCK_K is a weight tile's width, the
    period of the activations' order; a loop step takes K_TILES tiles (the loads of one step are
    what the pipeline keeps in flight, and the step's fixed costs, its barriers and waits, are
    shared by them), K_TILES dividing the tiles of [k_lo, k_hi) (a K split's range).

    With TAIL_M > 0 it also returns tail [BLOCK_N, TAIL_M] = the same product over the rows
    t_rows (t_ok) of A, from the same decoded weight tiles: a block of pairs a little over BLOCK_M
    decodes its weights once (a second block would decode them all again for its few pairs).
    With TAIL_M 0 the tail is zeros [BLOCK_N, 16] and t_rows, t_ok are not read."""
    HALF: tl.constexpr = BLOCK_K // 2  # bytes of a tile row
    GROUPS: tl.constexpr = BLOCK_K // 16  # scales of a tile row
    kb = tl.arange(0, HALF)
    kg = tl.arange(0, GROUPS)
    # int32 offsets: an expert's codes are its rows x K/2 bytes (18.9 MB at M3.1's widths).
    group = w_rows // 32
    lane = w_rows % 32
    # A row's place in its group's first tile; each tile moves 32 rows on.
    w_tile = w_ptr + (group * (32 * (k_end // 2)) + lane * HALF)[:, None] + kb[None, :]
    s_tile = s_ptr + (group * (32 * (k_end // 16)) + lane * GROUPS)[:, None] + kg[None, :]
    a_half = a_ptr + a_rows[:, None] + kb[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if TAIL_M > 0:
        t_half = a_ptr + t_rows[:, None] + kb[None, :]
        tail = tl.zeros([BLOCK_N, TAIL_M], dtype=tl.float32)
    else:
        t_half = a_half
        tail = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K * K_TILES):
        for u in tl.static_range(K_TILES):
            k = k0 + u * BLOCK_K
            b = tl.load(w_tile + k * 16, mask=w_ok[:, None], other=0)
            s = tl.load(s_tile + k * 2, mask=w_ok[:, None], other=0.0)
            # Each scale covers 8 bytes: read the [N, K/16] tile once, broadcast it in registers.
            s = _group_scales(s, DEQUANT)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, GROUPS, 8]), [BLOCK_N, HALF])
            lo, hi = _dequant(
                _mma_k_order(b, BLOCK_N, HALF), _mma_k_order(s, BLOCK_N, HALF), DEQUANT, DOT
            )
            a_even = tl.load(a_half + k, mask=a_ok[:, None], other=0.0)
            a_odd = tl.load(a_half + (k + HALF), mask=a_ok[:, None], other=0.0)
            acc = _dot_exact(lo, tl.trans(a_even), acc, DOT)
            acc = _dot_exact(hi, tl.trans(a_odd), acc, DOT)
            if TAIL_M > 0:
                t_even = tl.load(t_half + k, mask=t_ok[:, None], other=0.0)
                t_odd = tl.load(t_half + (k + HALF), mask=t_ok[:, None], other=0.0)
                tail = _dot_exact(lo, tl.trans(t_even), tail, DOT)
                tail = _dot_exact(hi, tl.trans(t_odd), tail, DOT)
    return acc, tail


@triton.jit
def _dot_exact(w, a, acc, DOT: tl.constexpr):
    """acc + w @ a with `a` rounded to DOT. An fp32 `a` against a bf16 DOT (fp32 models on the
    GPU) is split into three bf16 terms, hi + mid + lo, which hold all 24 bits: the products
    with the exact bf16 weights stay exact, so an fp32 model computes in fp32."""
    hi = a.to(DOT)
    acc = tl.dot(w, hi, acc, input_precision="ieee")
    if a.dtype == tl.float32 and tl.bfloat16 == DOT:
        rest = a - hi.to(tl.float32)
        mid = rest.to(DOT)
        acc = tl.dot(w, mid, acc, input_precision="ieee")
        lo = (rest - mid.to(tl.float32)).to(DOT)
        acc = tl.dot(w, lo, acc, input_precision="ieee")
    return acc
