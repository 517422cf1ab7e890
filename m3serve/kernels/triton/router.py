"""MoE router in Triton: fp32 logits, sigmoid, bias-selected top-k, renormalized scaled weights.

Semantics are those of `m3serve.kernels.moe.route_topk` with the routed scaling folded in:
logits = x·Wr^T in fp32 (x upcast to fp32; the dot runs with input_precision="ieee", so the
products and their accumulation are fp32, never TF32), s = sigmoid(logits), the k experts with
the largest s + e_score_correction_bias win, and their weights are their *unbiased* s divided by
the winners' sum, times `scale`. The sigmoid and the renormalization divide with IEEE rounding;
the exp is Triton's (ex2-based, a few ulps at these magnitudes), so scores match torch's to
about 1e-6 relative on the same logits.

Work split, decode (T <= GEMV_MAX_TOKENS): one program per expert reads that expert's weight row
over all of H and multiplies it with every token's x on CUDA cores (no dot tile padded to 16
tokens), writes the T logits to a scratch buffer and counts itself in with an atomic; the last
program to arrive reads all the logits back and runs the top-k epilogue, then resets the count
for the next call. One launch: on the H200 (`perf/bench_router.py`) 6.4-7.0 µs a call at T = 1-4
and 9.3 at T = 8, where the two-kernel split below takes 12.9; at T = 16 the split is faster
(12.9 against 14.7), the products per program growing with T. A program loads its whole row
in one step where its products fit (T = 1: 6.4 µs cold against 8.0 in steps of 1024, whose
loads waited for each other; 2026-12-05, H200). The arrival count is
one int32 per device, so calls must not run concurrently on two streams (the MoE layers route
one after another on the main stream).

Work split, otherwise. A program computes a [BLOCK_T tokens, BLOCK_E experts] tile of logits
over a chunk of the hidden dimension, as a loop of [BLOCK_T, BLOCK_K] x [BLOCK_K, BLOCK_E] fp32
dots, so each weight tile it loads serves all BLOCK_T tokens (up to 64: prefill reuses every
16 KB weight tile 64 times). The grid is (token tiles, expert blocks, hidden splits), sized
from shapes only:
- When the token tiles alone nearly fill the GPU (>= 3/4 of a program per SM: prefill of ~8K
  tokens), a program owns whole rows (all experts, all of H) and runs the top-k epilogue
  itself: one kernel, no intermediate.
- Otherwise (decode, verify, short prefill) the 3 MB weight is split over H — and for small token
  counts over experts as well — until there are ~2 programs per SM, so that the whole GPU streams
  the weight. Each program writes its fp32 partial logits to a [splits, T, E] scratch buffer; a
  second small kernel sums the partials of a token over the splits in a fixed order (a tl.sum
  over the split axis: same reduction tree every run, no atomics, so results are deterministic)
  and runs the epilogue. On sm_90 the second kernel is launched with programmatic dependent
  launch and waits on the device for the first, hiding its launch latency.
H splits are preferred to expert blocks: a split costs 8·E bytes per token (its partials written
and read back), an expert block a re-read of the token's row of x (2·H bytes, 12x more here).

Top-k in registers (the epilogue). A program holds whole rows of E scores. k rounds, each: the
row max of the biased scores among experts not yet taken, the lowest expert id attaining it
(exact ties go to the lowest id), that expert's unbiased score, then it is marked taken. Ids are
returned in that order: descending biased score, ties by ascending id. NaN biased scores rank
below every number (route_topk would rank them first); either way the k ids are distinct and in
[0, E), so a NaN input cannot produce an out-of-range expert id.

Capturability. Grids, block sizes and the split plan depend only on (T, E, H) and the device's SM
count (a cached host query); nothing reads device data on the host, so a call never
synchronizes and can be captured in a CUDA graph (the scratch buffer then comes from the graph's
memory pool). T is not specialized on (`do_not_specialize`), so token counts share compiled
kernels within a tile size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from m3serve.kernels.triton.attention.config import next_pow2, pdl_supported, sm_count
from m3serve.kernels.triton.router_kernels import (
    router_combine_kernel,
    router_gemv_kernel,
    router_logits_kernel,
)

# Hidden columns per dot step: a 16 KB fp32 weight tile at E = 128.
BLOCK_K = 32
# A split takes at least two dot steps; at most this many splits (bounds the combine's tile).
_MIN_CHUNK = 2 * BLOCK_K
MAX_SPLITS = 64
# Programs per SM to aim for when the token tiles alone do not fill the GPU.
_PROGRAMS_PER_SM = 2
# Logits a stage-1 program keeps in registers (BLOCK_T x BLOCK_E), and partials the combine
# loads at once (BLOCK_S x tokens x BLOCK_E).
_TILE = 8192
_COMBINE_TILE = 8192
# Rows of E scores live in registers: beyond this a 16-token tile spills.
MAX_EXPERTS = 512
# tl.dot needs every dimension >= 16.
_MIN_DOT = 16
# Up to this many tokens, the GEMV route (one program per expert over all of H).
GEMV_MAX_TOKENS = 8
# Products a GEMV program holds per hidden step (BLOCK_T x BLOCK_H): 64 fp32 a thread at 4 warps.
_GEMV_PRODUCTS = 8192
_GEMV_MAX_H = 8192


@dataclass(frozen=True)
class RoutePlan:
    """Launch shape of one `route` call (a function of T, E, H and the device only)."""

    block_t: int  # tokens per program: the dot's M (>= 16; padded rows are masked off)
    expert_blocks: int  # programs sharing one token tile's experts
    block_e: int  # experts per program (a power of two >= 16; padding masked off)
    splits: int  # programs sharing the hidden dimension
    chunk: int  # hidden columns per split, a multiple of BLOCK_K
    fused: bool  # one program per token tile does everything (no scratch, no second kernel)
    gemv: bool = False  # one program per expert on CUDA cores; the last to finish selects

    @property
    def programs(self) -> int:
        """Stage-1 programs per token tile."""
        return self.expert_blocks * self.splits

    @property
    def num_warps(self) -> int:
        """Stage-1 warps: a 64 x 128 tile (and the fused epilogue's copies of it) needs 8
        warps' registers; smaller tiles keep more logits per thread on 4."""
        return 8 if self.block_t * self.block_e >= _TILE else 4


def _pow2_floor(n: int) -> int:
    return triton.next_power_of_2(n + 1) // 2


def route_plan(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    device: torch.device,
    *,
    block_t: int | None = None,
    splits: int | None = None,
    expert_blocks: int | None = None,
) -> RoutePlan:
    """The launch plan `route` uses; block_t, splits and expert_blocks override the heuristic
    (and always take the tile route).

    Up to GEMV_MAX_TOKENS tokens, the GEMV route: one program per expert, all tokens in one
    block (their count rounded up to a power of two). Otherwise token tiles of up to 64 tokens
    (the token count rounded up to a power of two, >= 16). If the tiles give at least 3/4 of a
    program per SM, the kernel runs fused (the hidden split would only add a scratch round trip
    to a full wave). Else H is split until ~2 programs per SM (chunks of >= 64 columns, <= 64
    splits), then the experts, in blocks of >= 16, while the grid is at most half the target. A
    requested split count is rounded to whole BLOCK_K steps per chunk, which can lower it.
    """
    if num_experts < 1 or num_experts > MAX_EXPERTS:
        raise ValueError(f"{num_experts} experts: 1..{MAX_EXPERTS} fit a row in registers")
    all_e = max(next_pow2(num_experts), _MIN_DOT)
    overridden = not (block_t is None and splits is None and expert_blocks is None)
    if num_tokens <= GEMV_MAX_TOKENS and not overridden:
        return RoutePlan(next_pow2(num_tokens), num_experts, 1, 1, hidden, False, gemv=True)
    if block_t is None:
        block_t = min(max(next_pow2(num_tokens), _MIN_DOT), max(_TILE // all_e, _MIN_DOT))
    elif block_t < _MIN_DOT or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= {_MIN_DOT}, got {block_t}")
    tiles = triton.cdiv(max(num_tokens, 1), block_t)
    # The interpreter runs programs one after the other: fewest programs is fastest there.
    sms = 1 if device.type != "cuda" else sm_count(device.index or 0)
    target = _PROGRAMS_PER_SM * sms
    fill = 4 * tiles >= 3 * sms

    max_splits = max(1, min(MAX_SPLITS, hidden // _MIN_CHUNK))
    if splits is None:
        splits = 1 if fill else min(triton.cdiv(target, tiles), max_splits)
    elif not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    chunk = triton.cdiv(triton.cdiv(hidden, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(hidden, chunk)

    max_blocks = all_e // _MIN_DOT
    if expert_blocks is None:
        wanted = 1 if fill else max(target // (tiles * splits), 1)
        expert_blocks = min(_pow2_floor(wanted), max_blocks)
    elif expert_blocks < 1 or expert_blocks > max_blocks or expert_blocks & (expert_blocks - 1):
        raise ValueError(f"expert_blocks must be a power of two in [1, {max_blocks}]")
    fused = splits == 1 and expert_blocks == 1
    return RoutePlan(block_t, expert_blocks, all_e // expert_blocks, splits, chunk, fused)


def route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    scale: float,
    *,
    block_t: int | None = None,
    splits: int | None = None,
    expert_blocks: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Routing of x [T, H] (any float dtype) over weight [E, H] fp32 with bias [E] fp32.

    Returns (weights [T, k] fp32, ids [T, k] int64): the k experts with the largest
    sigmoid(x·W^T) + bias, in descending order of that biased score (exact ties: lower id
    first), and their unbiased sigmoid scores renormalized to sum to one, times `scale`.
    block_t, splits and expert_blocks override the launch plan (see `route_plan`); num_warps
    and num_stages the stage-1 kernel's launch.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: want [T, H], [E, H]"
        )
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError("weight and bias must be float32")
    if bias.shape != (num_experts,):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match {num_experts} experts")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if weight.stride(1) != 1 or not bias.is_contiguous():
        raise ValueError("weight rows and bias must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    device = x.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids

    plan = route_plan(
        num_tokens,
        num_experts,
        hidden,
        device,
        block_t=block_t,
        splits=splits,
        expert_blocks=expert_blocks,
    )
    block_topk = max(next_pow2(top_k), 2)
    if plan.gemv:
        _route_gemv(x, weight, bias, weights, ids, plan, top_k, scale, block_topk)
        return weights, ids
    all_e = plan.block_e * plan.expert_blocks
    pdl = not plan.fused and pdl_supported(x)
    if plan.fused:
        part = weights  # never touched: the fused kernel writes the outputs itself
    else:
        part = torch.empty(plan.splits, num_tokens, num_experts, dtype=torch.float32, device=device)
    grid = (triton.cdiv(num_tokens, plan.block_t), plan.expert_blocks, plan.splits)
    router_logits_kernel[grid](
        x,
        weight,
        bias,
        part,
        weights,
        ids,
        num_tokens,
        hidden,
        num_experts,
        plan.chunk,
        float(scale),
        x.stride(0),
        weight.stride(0),
        part.stride(0) if not plan.fused else 0,
        part.stride(1) if not plan.fused else 0,
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        BLOCK_T=plan.block_t,
        BLOCK_E=plan.block_e,
        BLOCK_K=BLOCK_K,
        BLOCK_TOPK=block_topk,
        EVEN_K=hidden % BLOCK_K == 0,
        FUSED=plan.fused,
        PDL=pdl,
        num_warps=num_warps or plan.num_warps,
        num_stages=num_stages or 3,
    )
    if plan.fused:
        return weights, ids

    block_s = max(next_pow2(plan.splits), 2)
    combine_t = max(1, min(_pow2_floor(_COMBINE_TILE // (block_s * all_e)), next_pow2(num_tokens)))
    # ~32 partials per thread: one wide load in flight, no spills.
    combine_warps = max(1, min(8, block_s * combine_t * all_e // 1024))
    router_combine_kernel[(triton.cdiv(num_tokens, combine_t),)](
        part,
        bias,
        weights,
        ids,
        num_tokens,
        num_experts,
        plan.splits,
        float(scale),
        part.stride(0),
        part.stride(1),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        BLOCK_T=combine_t,
        BLOCK_E=all_e,
        BLOCK_S=block_s,
        BLOCK_TOPK=block_topk,
        PDL=pdl,
        num_warps=combine_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return weights, ids


# One arrival count per device for the GEMV route (zero between calls: the last program resets it).
_ARRIVED: dict[torch.device, Tensor] = {}


def _route_gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    weights: Tensor,
    ids: Tensor,
    plan: RoutePlan,
    top_k: int,
    scale: float,
    block_topk: int,
) -> None:
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    arrived = _ARRIVED.get(x.device)
    if arrived is None:
        arrived = _ARRIVED[x.device] = torch.zeros(1, dtype=torch.int32, device=x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    block_h = min(_GEMV_MAX_H, _GEMV_PRODUCTS // plan.block_t, next_pow2(hidden))
    router_gemv_kernel[(num_experts,)](
        x,
        weight,
        bias,
        logits,
        arrived,
        weights,
        ids,
        num_tokens,
        hidden,
        num_experts,
        float(scale),
        x.stride(0),
        weight.stride(0),
        logits.stride(0),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        BLOCK_T=plan.block_t,
        BLOCK_H=block_h,
        ALL_E=max(next_pow2(num_experts), 2),
        BLOCK_TOPK=block_topk,
        EVEN_H=hidden % block_h == 0,
        num_warps=4,
    )
