"""Routed experts with NVFP4 weights (W4A16) in Triton: gate_up + SwiGLU-OAI, down + top-k combine.

Semantics are those of `m3serve.kernels.moe.moe_experts` on weights dequantized by
`m3serve.kernels.quant.dequant_nvfp4`: out[t] = sum_j topk_weights[t, j] * Expert_e(x[t]) with
e = topk_ids[t, j], Expert_e(x) = w2_e @ swiglu_oai(w13_e @ x), activations bf16, fp32 sums.

Layout: the checkpoint's values, its rows tiled once at load (`m3serve.kernels.nvfp4_tiles`:
rows in groups of 32, each group's K in contiguous tiles of TK = `tile_k(K)` elements, so a K
step reads 2 KB runs instead of a 64-byte piece of every row).
* w13 [E, 2I/32, H/TK, 32, TK/2] uint8: E2M1 codes two per byte, element 2i in the low nibble;
  rows [0, I) are w1 (gate), [I, 2I) w3 (up). w13_scale [E, 2I/32, H/TK, 32, TK/16]
  float8_e4m3fn, one per 16 elements along H. w13_global [E, 2] float32: the global scale of
  the w1 rows, then of the w3 rows.
* w2 [E, H/32, I/TK, 32, TK/2] uint8, w2_scale [E, H/32, I/TK, 32, TK/16] float8_e4m3fn,
  w2_global [E] float32.
W[n, k] = e2m1(code) * e4m3(scale[n, k // 16]) * global. H and I must be multiples of 32.

Dequantization happens in registers and is exact: e2m1 * e4m3 has at most 6 significant bits,
so the bf16 tile fed to tl.dot is exactly e2m1 * group scale (times a power of two); the global
scale multiplies the fp32 accumulator, per output row (per half for w13). On the GPU the nibbles
are decoded by inline PTX (`E2M1_PTX`), per byte: the three magnitude bits of a code, placed at
bf16 bits 6-8 and its sign at bit 15, are the bf16 number e2m1 * 2^-126 (the code for 0.5 lands
on the subnormal 2^-127), so one integer multiply-and-mask decodes two elements, and one bf16x2
multiply by (group scale * 2^119) turns them into e2m1 * scale * 2^-7, normal and exact; the
accumulator takes the 2^7 back. Per 8 elements that is 10 ALU and 4 integer-multiply (FMA pipe)
instructions, where a byte-table (prmt) lookup takes 17 ALU ones, plus the 4 bf16x2 scale
multiplies both need: at small batch the decode shares the critical path with HBM (H200, T = 1:
~29 elements per SM clock at full bandwidth; the ALU pipe retires 64 lane-ops per clock).
Elsewhere (Triton's interpreter, or `dequant="triton"`) plain Triton ops compute the same values.
The even and odd elements of a byte feed two dots (against the even and odd activation columns),
so nibbles are never interleaved; within a K tile the columns of both operands are permuted
(`_mma_k_order`) so that each thread's bytes are contiguous (16-byte shared-memory loads, no byte
shuffles) and decode straight into the MMA operand fragments: the dot is a sum over K, and any
order common to both operands gives the same result. The activations are stored in that order
before the kernels read them (`mma_k_position`: per K tile the even columns, then the odd ones,
each half permuted): x by `permute_k_kernel` (one small launch), act by the gate_up kernel's
epilogue. Each K step's two halves then go from the pipelined load straight to the tensor
cores; reordering them in registers instead cost a shared-memory round trip, two more barriers
and a second MMA wait per K step (sm_90 SASS), and registers (the prefill down kernel: 163 ->
118, two blocks an SM instead of one). A K loop step takes one weight tile, or `k_tiles` of them
(the plan's choice at one token: more bytes in flight per program).

The dots put weights on the left (out^T = W @ X^T): the MMA's M side is 64 or 128 weight rows,
its N side the 16..128 token rows of one expert, so decode wastes no weight-side tile.

The activation reorder, two kernels and a combine, in order on one stream:
* `permute_k_kernel`: x [T, H] in the MMA K order.
* `gate_up_kernel`: a program owns BLOCK_N/2 gate rows and the matching up rows of one expert
  and BLOCK_M (token, slot) pairs routed to it, applies the global scales and SwiGLU-OAI in
  registers and writes only act [pairs, I] (bf16, pair p = t * k + j; columns in the down
  kernel's MMA K order).
* `down_kernel`: BLOCK_N rows of w2 for the same pairs; scales by the global and by
  topk_weights[t, j] and writes y [pairs, H] fp32, each row exactly once.
* `combine_kernel`: out[t] = y[t*k] + y[t*k+1] + ... in slot order, cast to x.dtype. No
  atomics anywhere: results are bitwise deterministic.

Grouping pairs by expert (two routes, chosen from shapes):
* "slots" (decode: T*k <= 32 by default, up to 512 when asked for): no sort. Program
  (n-tile, s) handles the s-th distinct expert present in topk_ids (ascending id), found
  in-kernel from a histogram of the ids; it gathers its
  pairs BLOCK_M = 16 at a time (looping if there are more). Every selected expert's weights are
  read once per n-tile and the grid is (n-tiles, min(E, T*k)), so T = 1 runs 4 x 96 programs.
* "sorted" (prefill): moe_align-style metadata from two small kernels (`align.py`): pairs
  grouped by expert in pair order, in blocks of BLOCK_M + TAIL_M positions; program (n-tile,
  block) runs one expert over BLOCK_M pairs on the tensor cores and, where its block's tail
  (TAIL_M more positions, 16 or 32 by the plan; only an expert's last block fills it) holds
  pairs, those too with the same decoded weight tiles: routing is uneven, and an expert a few
  pairs over a multiple of BLOCK_M would otherwise decode all its weights once more for them.
  The block count is bounded from shapes (blocks past the end do nothing).

Expert parallelism: a rank holding E of the experts gets ids from `local_expert_ids`, where E
marks a pair whose expert another rank holds. With `skips` those pairs are left out of the slots
histogram, the sorted metadata and the combine (a SKIPS constexpr variant, so the single-rank
kernels compile as before); the rank's output is its partial sum, which the MoE all-reduces.

Variants: the block sizes come from `plan_moe` (a few fixed tiles, by route and mean pairs per
expert), there is no autotuning; pair and token counts are not specialized on. Grids and buffers
depend on shapes only and nothing reads back to the host, so a call can be captured in a CUDA
graph and replayed with new routing (any ids in [0, E)). On sm_90 the down and combine kernels are
launched with programmatic dependent launch and wait on the device for their predecessor.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from m3serve.kernels.nvfp4_tiles import CODES_PER_BYTE, TILE_ROWS, tile_k, tiled_shape
from m3serve.kernels.quant import NVFP4_GROUP
from m3serve.kernels.triton.attention.config import interpreted, pdl_supported
from m3serve.kernels.triton.nvfp4_moe.align import align_pairs
from m3serve.kernels.triton.nvfp4_moe.decode import DEQUANT_ASM, DEQUANT_TRITON
from m3serve.kernels.triton.nvfp4_moe.kernels import (
    combine_kernel,
    down_kernel,
    gate_up_kernel,
    permute_k_kernel,
    swiglu_reduce_kernel,
)
from m3serve.kernels.triton.nvfp4_moe.plan import (
    DEFAULT_CONFIG,
    ROUTE_SLOTS,
    SLOTS_MAX_PAIRS,
    NVFP4MoEConfig,
    overridden,
    plan_moe,
)

__all__ = ["SLOTS_MAX_PAIRS", "NVFP4MoEConfig", "nvfp4_moe"]

# bf16 is the model's; fp32 (split into three bf16 terms for the GPU's MMA) is exact.
_X_DTYPES = (torch.bfloat16, torch.float32)


def _check(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w13_global: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    w2_global: Tensor,
) -> tuple[int, int, int]:
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in _X_DTYPES:
        raise ValueError("x must be [T, H] bf16 or fp32, contiguous in H")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError("topk_ids must have one row per token of x")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
        raise ValueError("topk_ids must be int32/int64 and topk_weights float32")
    if w13.dim() != 5 or w2.dim() != 5:
        raise ValueError("w13 and w2 must be row-tiled (m3serve.kernels.nvfp4_tiles), 5-d")
    hidden = x.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] * TILE_ROWS // 2
    if hidden % 32 or inter % 32 or inter == 0:
        raise ValueError(f"H ({hidden}) and I ({inter}) must be multiples of 32")
    codes, scale = torch.uint8, torch.float8_e4m3fn
    expected = {
        "w13": (w13, tiled_shape(2 * inter, hidden, CODES_PER_BYTE), codes),
        "w13_scale": (w13_scale, tiled_shape(2 * inter, hidden, NVFP4_GROUP), scale),
        "w13_global": (w13_global, (2,), torch.float32),
        "w2": (w2, tiled_shape(hidden, inter, CODES_PER_BYTE), codes),
        "w2_scale": (w2_scale, tiled_shape(hidden, inter, NVFP4_GROUP), scale),
        "w2_global": (w2_global, (), torch.float32),
    }
    for name, (t, per_expert, dtype) in expected.items():
        shape = (num_experts, *per_expert)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name}: expected {dtype} {shape} (the row-tiled layout), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        # Experts may be strided (a slice of a bigger pool); each expert and the globals are dense.
        dense = t.is_contiguous() if t.dim() < 3 else t[0].is_contiguous()
        if not dense:
            raise ValueError(f"{name} must be contiguous apart from the expert dim")
    return num_experts, hidden, inter


def nvfp4_moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w13_global: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    w2_global: Tensor,
    alpha: float,
    limit: float,
    *,
    skips: bool = False,
    config: NVFP4MoEConfig = DEFAULT_CONFIG,
) -> Tensor:
    """[T, H] in x.dtype: sum_j topk_weights[t, j] * Expert_{topk_ids[t, j]}(x[t]).

    x [T, H] bf16 (or fp32, split into three bf16 terms for the GPU's MMA); topk_weights
    [T, k] fp32, already renormalized and scaled; topk_ids [T, k] int32/int64 in [0, E), or
    with `skips` in [0, E], where E (`local_expert_ids`' mark for an expert another rank holds)
    skips the pair (its own compiled variant: the single-rank kernels stay as they are);
    NVFP4 weights row-tiled (module docstring; `m3serve.kernels.nvfp4_tiles`). No host sync:
    capturable in a CUDA graph. `config` overrides the route, decode or tiles (tests,
    benchmarks); the default derives all from shapes.
    """
    num_experts, hidden, inter = _check(
        x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global
    )
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    out = torch.empty_like(x)
    if num_pairs == 0:
        return out
    plan = overridden(plan_moe(num_pairs, num_experts, config.route), config)
    tk_h, tk_i = tile_k(hidden), tile_k(inter)
    on_gpu = not interpreted(x)
    if config.dequant == "asm" and not on_gpu:
        raise ValueError("the inline-PTX decode needs a CUDA device (not the interpreter)")
    use_asm = config.dequant == "asm" or (config.dequant == "auto" and on_gpu)
    dequant = DEQUANT_ASM if use_asm else DEQUANT_TRITON
    # The interpreter's tl.dot multiplies bf16 as raw bits; fp32 operands give the same exact
    # products there.
    dot = tl.bfloat16 if on_gpu else tl.float32
    pdl = config.pdl and pdl_supported(x)

    flat_ids = topk_ids.reshape(-1)
    mix = topk_weights.reshape(-1)
    if plan.route == ROUTE_SLOTS:
        grid_r = min(num_experts, num_pairs)
        sorted_pairs = block_expert = flat_ids  # unused by this route
    else:
        sorted_pairs, block_expert, grid_r = align_pairs(
            flat_ids, num_experts, plan.block_m, plan.tail_m
        )
    # The interpreter's casts to bf16 truncate: it keeps the activation in fp32 instead.
    act_dtype = x.dtype if on_gpu else torch.float32
    act = torch.empty(num_pairs, inter, dtype=act_dtype, device=x.device)
    x_k = torch.empty_like(x)
    block_t = 16
    permute_k_kernel[(triton.cdiv(tokens, block_t), hidden // tk_h)](
        x, x.stride(0), x_k, x_k.stride(0), tokens, BLOCK_T=block_t, TILE_K=tk_h, num_warps=4
    )
    # A step's tiles must divide both projections' K tiles, and a split their loop steps.
    k_tiles = math.gcd(plan.k_tiles, hidden // tk_h, inter // tk_i)
    split = math.gcd(plan.split_k, hidden // tk_h // k_tiles, inter // tk_i // k_tiles)
    y = torch.empty(split * num_pairs, hidden, dtype=torch.float32, device=x.device)
    # Split gate_up: each split's pre-activations (gate and up columns), summed by the reduce.
    pre = act
    if split > 1:
        pre = torch.empty(split * num_pairs, 2 * inter, dtype=torch.float32, device=x.device)
    common = {
        "P_PAD": plan.p_pad,
        "E_PAD": triton.next_power_of_2(num_experts),
        "SKIPS": skips,
        "BLOCK_M": plan.block_m,
        "TAIL_M": plan.tail_m,
        "K_TILES": k_tiles,
        "SPLIT_K": split,
        "DEQUANT": dequant,
        "DOT": dot,
        "PDL": pdl,
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
    }
    if plan.max_registers and on_gpu:
        common["maxnreg"] = plan.max_registers
    gate_up_kernel[(triton.cdiv(inter, plan.gate_up_n // 2), grid_r, split)](
        x_k, x_k.stride(0), flat_ids, sorted_pairs, block_expert,
        w13, w13.stride(0), w13_scale, w13_scale.stride(0), w13_global, act, act.stride(0),
        pre, pre.stride(0), num_pairs, num_experts, hidden, inter, float(alpha), float(limit),
        TOP_K=top_k, ROUTE=plan.route, BLOCK_N=plan.gate_up_n, BLOCK_K=tk_h, ACT_TILE_K=tk_i,
        **common,
    )  # fmt: skip
    launch_pdl = {"launch_pdl": True} if pdl else {}
    if split > 1:
        block_p, block_n = 16, 256
        swiglu_reduce_kernel[(triton.cdiv(inter, block_n), triton.cdiv(num_pairs, block_p))](
            pre, pre.stride(0), act, act.stride(0), num_pairs, inter, float(alpha), float(limit),
            SPLIT_K=split, BLOCK_P=block_p, BLOCK_N=block_n, ACT_TILE_K=tk_i, PDL=pdl,
            num_warps=4, **launch_pdl,
        )  # fmt: skip
    down_kernel[(triton.cdiv(hidden, plan.down_n), grid_r, split)](
        act, act.stride(0), flat_ids, sorted_pairs, block_expert,
        w2, w2.stride(0), w2_scale, w2_scale.stride(0), w2_global, mix, y, y.stride(0),
        num_pairs, num_experts, hidden, inter,
        ROUTE=plan.route, BLOCK_N=plan.down_n, BLOCK_K=tk_i, **common,
        **launch_pdl,
    )  # fmt: skip
    block = min(triton.next_power_of_2(hidden), 2048)
    combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y, y.stride(0), flat_ids, num_experts, num_pairs, out, out.stride(0), hidden,
        TOP_K=top_k, SPLIT_K=split, BLOCK=block, SKIPS=skips, PDL=pdl, num_warps=4,
        **launch_pdl,
    )  # fmt: skip
    return out
