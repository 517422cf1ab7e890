"""W8A16 MXFP8 linear in Triton: ``y = x @ W^T`` with W dequantized in registers (or, at prefill
sizes, into a bf16 scratch for cuBLAS).

Layout (the checkpoint's, unchanged: `prepare_mxfp8` only validates and makes it contiguous):
codes [N, K] float8_e4m3fn, row-major (K contiguous); scales [N, K/32] uint8 E8M0, row-major.
W[n, k] = float(codes[n, k]) * 2**(scales[n, k // 32] - 127). A program's [BLOCK_N, BLOCK_K]
code tile is BLOCK_N rows of BLOCK_K contiguous bytes (whole 128-byte lines at BLOCK_K 128), and
its scales are BLOCK_N runs of BLOCK_K/32 bytes that the next K steps reuse from L2, so DRAM
reads every byte once; a transposed or tile-packed scale layout would save only L2 traffic.

Algorithm. One kernel computes the transposed tile ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T``
over a range of K, so the weights are the dot's left operand: the dequantized tile can feed the
MMA from registers (wgmma takes A from registers, B only from shared memory), the weight rows fill
the MMA's 64-row side even at one token, and the token count only has to reach the dot's
16-column minimum. Per K step it loads BLOCK_K codes per weight row and
their BLOCK_K/32 scale bytes, builds 2**(e - 127) from the exponent bits (exact; byte 0 is the
subnormal 2**-127, byte 255 NaN, as in `m3serve.kernels.quant`), multiplies in fp32 and casts to
bf16. That cast is exact whenever W is a normal number (|W| >= 2**-126, i.e. every weight a real
checkpoint holds): an E4M3 code has 4 significant bits and the scale is a power of two. The dot
runs on bf16 tiles with an fp32 accumulator. Activations are split into bf16 terms so that their
products with the exact W are exact too: bf16 x is one term, fp16 x two (hi + remainder, exact),
fp32 x three (hi + mid + lo: all 24 bits). Under Triton's interpreter (CPU tests) the dot
operands are fp32 instead, since its bf16 dot multiplies raw bits; the split is still taken.

Paths, chosen from shapes only by `plan_mxfp8` (no autotuning, no runtime search):

* GEMV, M <= GEMV_MAX_M = 2 (decode at batch 1-2): no tensor cores. A program owns BLOCK_N whole
  weight rows; per K step it loads a [BLOCK_N, BLOCK_K] code tile, converts it to fp32, and for
  each token sums the code x activation products of every 32-block before scaling the block sum
  by its power of two (exact, so the order of scaling does not matter). The MMA path below pads M
  to 16 and moves every dequantized tile through shared memory into the MMA's operand layout;
  here the tile stays in the layout it was loaded in, which is what bounds a memory-bound call.
  Products and sums are fp32 for every activation dtype (no bf16 split needed). BLOCK_N 4,
  BLOCK_K 1024, 4 warps, 3 stages; K is split only when the rows give under 2 programs per SM
  (never at the model's shapes). On the H200 (`perf/bench_mxfp8_linear.py --gemv-sweep`, 24
  tile choices a shape) these tiles were the fastest or within 7 % of it on the four projections
  at M 1 and 2 (74 % of read bandwidth on qkv and o_proj at M = 1); the earlier 8 x 512 tiles
  left o_proj (6144 x 8192) at 61 %. It beats the MMA path at M 1-2 and loses from M = 4.
* decode, M <= 64: BLOCK_M = 16, 32 or 64 (M padded to the next one), BLOCK_K 128, 4 warps;
  per M tile (`_DECODE_TILES`) BLOCK_N 128 and 3 stages at M tile 16, BLOCK_N 64 and 4 stages
  at 32 and 64. One M tile, so every weight byte is read once per call. When the N tiles alone
  do not give ~2 programs per SM, K is split across programs (at least 2 K
  steps each); each split writes an fp32 partial [split, M, N] and a second kernel sums the
  splits in a fixed order and casts (deterministic, no atomics). That kernel is launched with
  programmatic dependent launch on sm_90, so its launch overlaps the first kernel. On the H200
  at M 4-16 the 128-row tiles took 20-25 % off the 64-row ones on qkv, o_proj and the shared
  gate_up (qkv 30.0 µs vs 40.2 at M 8), at M 64 10-20 %; at M 32 they lost (register-bound).
  A K step of 128 holds a row's scales in one aligned 4-byte word, which the kernel is told,
  so the 128-row tiles load them 4 bytes a thread, wide enough for the pipeline's
  asynchronous copies; as single bytes they were a synchronous load in every K step and a
  trip through shared memory (sm_90 SASS, perf/sm90_resources.py). The 64-row tiles (M tile
  32) give a thread only 2 of those bytes, a synchronous load even aligned; they, and the M
  tile 64, load each row's word as one int32 instead (`Mxfp8Plan.scale_words`). On the H200
  (2026-12-05, the four projections, same machine): M tile 32 7-14 % faster with words, M
  tile 64 12-20 % faster (qkv 76.4 -> 61.3 µs), M tile 16 15-47 % slower (it keeps bytes).
  With words the 64-row tiles also won at M tile 64, where the 128-row ones had won with bytes
  (the same day's `--decode-sweep`, M 64: qkv 45.6 µs against 60.8, o_proj 34.9 against 44.4).
* prefill, M > 64: BLOCK_M 128, BLOCK_N 128, BLOCK_K 128, 8 warps, 3 stages, each row's 4
  scales of a K step as one word; tiles in groups of 16 M tiles (2048 tokens) so the programs
  running together share their weight tiles through L2. Split-K applies too while the tiles
  leave SMs idle (e.g. M = 128 on a narrow N). A K step of 64 gave a row 2 scale bytes, a
  synchronous load in every step (loading them a step ahead ran 4-10 % slower on the H200,
  2026-12-05); at 128 with words the four projections of a layer took 200 µs instead of 245 at
  M 80, 191 instead of 220 at M 128 (an H100, 2026-12-06, `--mid-sweep`: a mixed step's or a
  decode batch's rows past one decode tile), and it beat the K-step-64 tile at every M up to
  512 (bf16 x takes the dequantized path from DEQUANT_MIN_M on, as fast as any tile tried there).
* dequantized, M >= DEQUANT_MIN_M and bf16 x (the served model's dtype): one memory-bound kernel
  writes W as bf16 into a scratch buffer (exact, as above), then cuBLAS multiplies. Converting
  in the MMA kernel's registers costs every M tile the whole conversion again and keeps that
  kernel near half of cuBLAS's bf16 rate; the dequantization reads 1 and writes 2 bytes per
  weight once per call, which the GEMM's own work hides from this M on (perf/bench_mxfp8_linear.py
  measures both paths). The scratch comes from the caching allocator (the graph pool under
  capture) and is at most the largest projection in bf16. Other x dtypes keep the MMA tiles.
  With `--mxfp8-bf16-copy` (the hopper default) the model holds that bf16 W beside the codes (2
  bytes a weight more, dequantized once at load) and this path is cuBLAS alone, taken from
  COPY_MIN_M (65) on: past the decode tiles nothing is left to amortize.

Compiled variants: one per (tile config: the 3 decode buckets + prefill, and GEMV at M padded to
1 or 2) x (direct store or split partials) x x dtype, times EVEN_K (K % BLOCK_K == 0, true for
every model shape), plus one reduction kernel per output dtype and one dequantization kernel.
M is not specialized on (`do_not_specialize`), and every other integer argument is a multiple of
16 at the model's shapes, so one call per (layer shape, M bucket) compiles everything a server
will run.

x may have leading dims ([..., K] -> [..., N], as torch.nn.functional.linear) and any strides;
`out` rows may be strided (e.g. a column slice of a fused buffer).

CUDA graphs: the grid and the split count are functions of (M, N, K) and the SM count; nothing
reads device data on the host or synchronizes, and the split partials come from the caching
allocator (the graph's pool under capture).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from m3serve.kernels.quant import MXFP8_BLOCK
from m3serve.kernels.triton.mxfp8_kernels import (
    mxfp8_dequant_kernel,
    mxfp8_gemv_kernel,
    mxfp8_mma_kernel,
    splitk_reduce_kernel,
)

# M up to this is the decode path: one M tile, so the weights are read once per call.
DECODE_MAX_M = 64
# Past one 128-row MMA tile, bf16 x takes the dequantized path (W to bf16 once, then cuBLAS):
# on the H200 it is 1.2-2.1x faster from M 160 on and 0.7-1.1x at M 64-128 (bench_mxfp8_linear).
DEQUANT_MIN_M = 129
# With W held in bf16 beside the codes (`--mxfp8-bf16-copy`) there is no conversion left to
# amortize: cuBLAS reads the copy from the first M past the decode tiles (an H100, 12-06: a
# layer's four projections 131 µs against 203 for the 128-row tile at M 80, 133 against 193 at
# 128, 148 against 340 for the per-call dequantization at 256).
COPY_MIN_M = DECODE_MAX_M + 1
_DEQUANT_BLOCK_N = 32
_DEQUANT_BLOCK_K = 256
# M up to this takes the GEMV kernel (CUDA cores; its cost grows with M, the MMA path's does not).
GEMV_MAX_M = 2
_GEMV_BLOCK_N = 4
_GEMV_BLOCK_K = 1024
# An explicit GEMV plan (tuning) may go this far; each row is one more pass over every tile.
_GEMV_PLAN_MAX_M = 16
# Smallest tl.dot dimension: decode pads M up to this.
MIN_BLOCK_M = 16


class DecodeTiles(NamedTuple):
    """One decode M tile's launch. Decode programs are small (4 warps, 25-50 KB of shared
    memory), so several share an SM and their loads overlap."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    per_sm: int  # programs per SM below which K is split
    # Each row's 4 scales of a K step of 128 as one word (`Mxfp8Plan.scale_words`): measured
    # per tile on the H200 (`--decode-sweep` times both loads), not derived.
    words: bool = False


# From `perf/bench_mxfp8_linear.py --decode-sweep` (H200, see the module docstring).
_DECODE_TILES = {
    16: DecodeTiles(128, 128, 4, 3, 2),
    32: DecodeTiles(64, 128, 4, 4, 2, words=True),
    64: DecodeTiles(64, 128, 4, 4, 2, words=True),
}
_PREFILL_PROGRAMS_PER_SM = 1
_MAX_SPLIT = 32
# Each split streams at least this many K steps, so that the pipeline has loads to overlap.
_MIN_STEPS_PER_SPLIT = 2
# Prefill tile order: this many M tiles share each weight tile while it is in L2.
_GROUP_M = 16
_REDUCE_BLOCK_N = 1024

_X_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@dataclass(frozen=True)
class Mxfp8Plan:
    """Launch parameters of one call; `plan_mxfp8` derives them from the shapes."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int  # programs along K; > 1 adds the partial-sum reduction kernel
    num_warps: int
    num_stages: int
    gemv: bool = False  # the CUDA-core kernel (block_m is then M padded to a power of two)
    # bf16 x: W dequantized to bf16, then cuBLAS (the tiles above serve other x dtypes)
    dequant: bool = False
    # The MMA kernel loads each row's 4 scales of a K step of 128 as one word (K % 128 == 0).
    scale_words: bool = False


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _interpreted(t: Tensor) -> bool:
    return t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(t: Tensor) -> int:
    # The interpreter runs programs one after another: the fewest programs is the fastest there.
    return 1 if _interpreted(t) else _sm_count(t.device.index or 0)


def plan_mxfp8(
    m: int,
    n: int,
    k: int,
    num_sms: int,
    gemv_max_m: int = GEMV_MAX_M,
    dequant_min_m: int = DEQUANT_MIN_M,
    decode_tiles: tuple[int, int, int, int, int] | None = None,
) -> Mxfp8Plan:
    """Tiles and split count for x [m, k] @ W[n, k]^T on a device with `num_sms` SMs; M up to
    `gemv_max_m` takes the GEMV kernel, M from `dequant_min_m` the dequantized path, and the
    MMA decode path `decode_tiles` (DecodeTiles' fields up to `per_sm`, scales as bytes) instead
    of `_DECODE_TILES`' (benchmarks move the crossovers and sweep the tiles)."""
    if m <= gemv_max_m:
        return _plan_gemv(m, n, k, num_sms)
    words = False
    if m <= DECODE_MAX_M:
        block_m = max(MIN_BLOCK_M, triton.next_power_of_2(max(m, 1)))
        chosen = DecodeTiles(*decode_tiles) if decode_tiles else _DECODE_TILES[block_m]
        block_n, block_k, warps, stages, per_sm, words = chosen
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 128, 8, 3
        per_sm, words = _PREFILL_PROGRAMS_PER_SM, True
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = split_for(tiles, triton.cdiv(k, block_k), per_sm * num_sms)
    dequant = m >= dequant_min_m
    return Mxfp8Plan(block_m, block_n, block_k, split, warps, stages, False, dequant, words)


def split_for(tiles: int, k_steps: int, target: int) -> int:
    """Programs along K so that `tiles` output tiles make about `target` programs, each split
    streaming at least `_MIN_STEPS_PER_SPLIT` of the `k_steps` K steps (1: no split)."""
    if tiles >= target:
        return 1
    wanted = min(triton.next_power_of_2(triton.cdiv(target, tiles)), _MAX_SPLIT)
    steps = max(triton.cdiv(k_steps, wanted), min(_MIN_STEPS_PER_SPLIT, k_steps))
    return triton.cdiv(k_steps, steps)


def _plan_gemv(m: int, n: int, k: int, num_sms: int) -> Mxfp8Plan:
    block_k = _GEMV_BLOCK_K
    while block_k > 32 and k % block_k:
        block_k //= 2
    tiles = triton.cdiv(n, _GEMV_BLOCK_N)
    k_steps = triton.cdiv(k, block_k)
    split = 1
    # Split K (and pay the reduction kernel) only while the rows give under 2 programs per SM.
    target = 2 * num_sms
    if tiles < target:
        wanted = min(triton.next_power_of_2(triton.cdiv(target, tiles)), _MAX_SPLIT)
        split = triton.cdiv(k_steps, max(triton.cdiv(k_steps, wanted), 1))
    block_m = triton.next_power_of_2(max(m, 1))
    return Mxfp8Plan(block_m, _GEMV_BLOCK_N, block_k, split, 4, 3, gemv=True)


def _check_weight(codes: Tensor, scales: Tensor) -> tuple[int, int]:
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes: expected dtype torch.float8_e4m3fn, got {codes.dtype}")
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales: expected dtype torch.uint8, got {scales.dtype}")
    if codes.dim() != 2 or codes.shape[1] % MXFP8_BLOCK != 0:
        raise ValueError(
            f"codes: expected shape [N, K] with K divisible by {MXFP8_BLOCK}, "
            f"got {tuple(codes.shape)}"
        )
    n, k = codes.shape
    if tuple(scales.shape) != (n, k // MXFP8_BLOCK):
        raise ValueError(
            f"scales: expected shape {(n, k // MXFP8_BLOCK)} for codes {tuple(codes.shape)}, "
            f"got {tuple(scales.shape)}"
        )
    if scales.device != codes.device:
        raise ValueError("codes and scales must be on the same device")
    return n, k


def _check_plan(p: Mxfp8Plan, m: int) -> None:
    if p.block_k % MXFP8_BLOCK != 0 or p.block_n & (p.block_n - 1):
        raise ValueError(
            f"invalid plan {p}: block_k must be a multiple of 32, block_n a power of 2"
        )
    if p.gemv and m > _GEMV_PLAN_MAX_M:
        raise ValueError(f"invalid plan {p}: the GEMV kernel takes at most {_GEMV_PLAN_MAX_M} rows")
    if not p.gemv and min(p.block_m, p.block_n, p.block_k) < 16:
        raise ValueError(f"invalid plan {p}: MMA blocks must be >= 16")
    if p.scale_words and (p.gemv or p.block_k != 128):
        raise ValueError(f"invalid plan {p}: scale words need the MMA kernel at block_k 128")


def prepare_mxfp8(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Checkpoint MXFP8 weight -> the layout `mxfp8_linear` reads, once at load.

    The kernel reads the checkpoint layout itself (see the module docstring): this validates the
    pair and makes both contiguous, returning the same tensors when they already are.
    """
    _check_weight(codes, scales)
    return codes.contiguous(), scales.contiguous()


def mxfp8_linear(
    x: Tensor,
    codes: Tensor,
    scales: Tensor,
    out: Tensor | None = None,
    *,
    plan: Mxfp8Plan | None = None,
    bf16: Tensor | None = None,
) -> Tensor:
    """y = x @ W^T for W stored as MXFP8. x [M, K] (bf16, fp16 or fp32), codes [N, K]
    float8_e4m3fn, scales [N, K // 32] uint8 (E8M0). Returns [M, N] in x.dtype (fp32 accumulation).

    Leading dims are flattened as in `torch.nn.functional.linear` (x [..., K] -> [..., N]).
    `out` [..., N] in x.dtype receives the result (preallocated buffers for CUDA graphs); its
    rows may be strided. `plan` overrides the launch parameters `plan_mxfp8` derives from the
    shapes (tests and tuning); block sizes must be powers of two >= 16, block_k a multiple of 32.
    `bf16` [N, K]: W in bf16, held beside the codes (`--mxfp8-bf16-copy`); bf16 x past the
    decode tiles (M >= COPY_MIN_M) is then multiplied by cuBLAS on it, with no per-call
    dequantization (the plan's dequantized path from COPY_MIN_M instead of DEQUANT_MIN_M).
    """
    n, k = _check_weight(codes, scales)
    if x.dtype not in _X_TERMS:
        raise ValueError(f"x: expected bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] for codes [{n}, {k}], got {tuple(x.shape)}")
    if x.device != codes.device:
        raise ValueError("x and the weight must be on the same device")
    if bf16 is not None and (
        tuple(bf16.shape) != (n, k) or bf16.dtype != torch.bfloat16 or bf16.device != x.device
    ):
        raise ValueError(f"bf16: expected W [{n}, {k}] bfloat16 on {x.device}")
    if codes.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("codes and scales must be contiguous along K (see prepare_mxfp8)")
    out_shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {list(out_shape)} {x.dtype} on {x.device}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    try:
        out2 = out if out.dim() == 2 else out.view(-1, n)
    except RuntimeError as err:
        raise ValueError("out must be viewable as [rows, N]") from err
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out

    min_m = DEQUANT_MIN_M if bf16 is None else COPY_MIN_M
    p = plan or plan_mxfp8(m, n, k, _num_sms(x), dequant_min_m=min_m)
    _check_plan(p, m)
    if p.dequant and x2.dtype == torch.bfloat16:
        _bf16_matmul(x2, dequant_mxfp8_bf16(codes, scales) if bf16 is None else bf16, out2)
        return out
    k_steps = triton.cdiv(k, p.block_k)
    steps_per_split = triton.cdiv(k_steps, max(p.split_k, 1))
    split = triton.cdiv(k_steps, steps_per_split)  # no empty splits
    direct = split == 1
    interpreted = _interpreted(x)
    pdl = not direct and not interpreted and _sm90(x.device.index or 0)
    part = out2 if direct else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if p.gemv:
        mxfp8_gemv_kernel[(triton.cdiv(n, p.block_n), split)](
            x2, codes, scales, out2, part, m, n, k, steps_per_split * p.block_k,
            x2.stride(0), x2.stride(1), codes.stride(0), scales.stride(0),
            out2.stride(0), out2.stride(1),
            M_PAD=triton.next_power_of_2(m), BLOCK_N=p.block_n, BLOCK_K=p.block_k,
            EVEN_K=k % p.block_k == 0, DIRECT=direct, PDL=pdl,
            num_warps=p.num_warps, num_stages=p.num_stages,
        )  # fmt: skip
    else:
        _mxfp8_mma(x2, codes, scales, out2, part, p, steps_per_split, interpreted, direct, pdl)
    if not direct:
        splitk_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK_N))](
            part, out2, m, n, split, out2.stride(0), out2.stride(1),
            BLOCK_N=_REDUCE_BLOCK_N, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out


def dequant_mxfp8_bf16(codes: Tensor, scales: Tensor) -> Tensor:
    """W [N, K] in bf16 from an MXFP8 weight, on its device (one Triton kernel)."""
    n, k = _check_weight(codes, scales)
    w = torch.empty(n, k, dtype=torch.bfloat16, device=codes.device)
    grid = (triton.cdiv(n, _DEQUANT_BLOCK_N), triton.cdiv(k, _DEQUANT_BLOCK_K))
    mxfp8_dequant_kernel[grid](
        codes, scales, w, n, k, codes.stride(0), scales.stride(0), w.stride(0),
        BLOCK_N=_DEQUANT_BLOCK_N, BLOCK_K=_DEQUANT_BLOCK_K, num_warps=4,
    )  # fmt: skip
    return w


def _bf16_matmul(x2: Tensor, w: Tensor, out2: Tensor) -> None:
    if out2.is_contiguous():
        torch.mm(x2, w.t(), out=out2)
    else:  # a column slice of a fused buffer: cuBLAS writes dense rows
        out2.copy_(torch.mm(x2, w.t()))


def _mxfp8_mma(
    x2: Tensor,
    codes: Tensor,
    scales: Tensor,
    out2: Tensor,
    part: Tensor,
    p: Mxfp8Plan,
    steps_per_split: int,
    interpreted: bool,
    direct: bool,
    pdl: bool,
) -> None:
    (m, k), n = x2.shape, codes.shape[0]
    split = part.shape[0] if not direct else 1
    tiles = triton.cdiv(m, p.block_m) * triton.cdiv(n, p.block_n)
    # A row's scales start on a word when K is a multiple of 128 and the tensor is word-aligned.
    words = p.scale_words and k % 128 == 0 and scales.data_ptr() % 4 == 0
    mxfp8_mma_kernel[(tiles, split)](
        x2, codes, scales, out2, part, m, n, k, steps_per_split * p.block_k,
        x2.stride(0), x2.stride(1), codes.stride(0), scales.stride(0),
        out2.stride(0), out2.stride(1),
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=_GROUP_M,
        X_TERMS=_X_TERMS[x2.dtype], DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16,
        EVEN_K=k % p.block_k == 0, DIRECT=direct, PDL=pdl, SCALE_WORDS=words,
        num_warps=p.num_warps, num_stages=p.num_stages,
    )  # fmt: skip
