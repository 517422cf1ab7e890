"""The sorted route's metadata in two small Triton kernels: (token, slot) pairs grouped by expert
into blocks of BLOCK_M + TAIL_M positions, in ascending pair order within an expert.

An expert with c pairs gets n = ceil((c - TAIL_M) / BLOCK_M) blocks (at least one): every block
but the last holds BLOCK_M of its pairs and an empty tail, the last the rest, up to BLOCK_M +
TAIL_M. So only an expert's last block ever runs the kernels' tail (`nvfp4_mma`), and only for
the few pairs past a multiple of BLOCK_M that would otherwise cost a block, and a decode of the
expert's weights, of their own. (Blocks of BLOCK_M + TAIL_M pairs each put every block on the
tail's slower path: H200, 128 experts at 192 pairs each, 9300 µs against 8432 without tails.)

torch did this with about twenty kernels a layer (scatter-add counts, cumsums, a stable radix
argsort, searchsorted), the sort alone 27 µs a layer in a mixed step on the H200. Here pairs are
cut into chunks of CHUNK:
* `_count_kernel`, one program a chunk: how many of its pairs go to each expert;
* `_place_kernel`, one program per CHUNK positions of the padded layout (at least one a chunk):
  from all chunks' counts, each expert's padded start and how many of its pairs earlier chunks
  hold; program c < chunks places chunk c's pairs: a pair's rank within its expert is that plus
  the number of earlier pairs of its expert in its own chunk (a cumsum over a one-hot [CHUNK, E]
  tile), and the rank gives its block and place in it. Every program then writes -1 to the
  padding among its CHUNK positions, and their blocks' experts.
  (One program per chunk doing all the padding took 72 µs a layer at 64 tokens on the H200: two
  programs walked 2176 positions.)
Placed pairs and padding are disjoint sets of positions, so no program waits for another, and the
order within an expert is the pairs' order: the same as a stable sort, every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Pairs per program. Both kernels hold [CHUNK, experts] one-hot tiles: at 128 experts a CHUNK of
# 128 gave each thread 128 elements a tile and the two kernels took 25-30 µs at 256-4096 pairs;
# 64 takes 11-18 (an H100, 2026-12-07; 32 was faster up to 512 pairs and slower past them). In a
# decode layer they run beside the shared expert, which takes longer: the layer at batch 64 and
# 128 timed the same with either (perf/results/h100_2026-12-07d_shared_rows_floor/).
CHUNK = 64
_COUNT_ROWS = 16  # chunks' counts read at a time by a placing program


@triton.jit(do_not_specialize=["num_pairs", "num_experts"])
def _count_kernel(
    ids_ptr, num_pairs, num_experts, counts_ptr, CHUNK: tl.constexpr, E_PAD: tl.constexpr
):
    pair = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=num_experts).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    # ids >= num_experts (padding, or an expert another rank holds) match no column.
    hit = (ids[:, None] == experts[None, :]) & (ids < num_experts)[:, None]
    tl.store(counts_ptr + tl.program_id(0) * E_PAD + experts, tl.sum(hit.to(tl.int32), 0))


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_chunks", "blocks"])
def _place_kernel(
    ids_ptr,
    num_pairs,
    num_experts,
    counts_ptr,
    num_chunks,
    sorted_ptr,
    block_expert_ptr,
    blocks,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr,
):
    STRIDE: tl.constexpr = BLOCK_M + TAIL_M  # positions a block
    pid = tl.program_id(0)  # this program's positions; also its chunk of pairs, if any
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)  # pairs per expert in earlier chunks
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + rows[:, None] * E_PAD + experts[None, :]
        part = tl.load(ptrs, mask=(rows < num_chunks)[:, None], other=0)
        counts += tl.sum(part, 0)
        before += tl.sum(tl.where((rows < pid)[:, None], part, 0), 0)
    # Blocks an expert takes (BLOCK_M pairs in each but the last, which takes the rest), and
    # the index of its last.
    n_blocks = tl.where(counts > 0, tl.maximum((counts - TAIL_M + BLOCK_M - 1) // BLOCK_M, 1), 0)
    last = tl.maximum(n_blocks - 1, 0)
    padded = n_blocks * STRIDE
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded

    if pid < num_chunks:
        pair = pid * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=num_experts).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]) & (ids < num_experts)[:, None]
        ones = hit.to(tl.int32)
        # Earlier pairs of the same expert, in earlier chunks and in this one.
        rank = before[None, :] + tl.cumsum(ones, 0) - ones
        # The pair's block and its place there (past BLOCK_M only in the last: its tail).
        block = tl.minimum(rank // BLOCK_M, last[None, :])
        local = block * STRIDE + rank - block * BLOCK_M
        dest = tl.sum(tl.where(hit, pad_start[None, :] + local, 0), 1)
        tl.store(sorted_ptr + dest, pair, mask=tl.sum(ones, 1) > 0)

    # Padding and block owners among this program's positions.
    q = pid * CHUNK + tl.arange(0, CHUNK)
    # Position q belongs to the expert whose padded range holds it: the number of experts whose
    # range ends at or before q (num_experts or more past the last range).
    owner = tl.sum((pad_end[None, :] <= q[:, None]).to(tl.int32), 1)
    mine = owner[:, None] == experts[None, :]
    local = q - tl.sum(tl.where(mine, pad_start[None, :], 0), 1)
    owner_last = tl.sum(tl.where(mine, last[None, :], 0), 1)
    in_last = tl.sum(tl.where(mine, (counts - last * BLOCK_M)[None, :], 0), 1)
    block, at = local // STRIDE, local % STRIDE
    # Pairs fill the first BLOCK_M places of each block before the owner's last, `in_last` of it.
    held = at < tl.where(block < owner_last, BLOCK_M, in_last)
    inside = q < blocks * STRIDE
    tl.store(sorted_ptr + q, tl.full([CHUNK], -1, tl.int32), mask=inside & ~held)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(block_expert_ptr + q // STRIDE, owner, mask=inside & (q % STRIDE == 0))


def align_pairs(
    flat_ids: Tensor, num_experts: int, block_m: int, tail_m: int = 0
) -> tuple[Tensor, Tensor, int]:
    """(sorted_pairs [blocks * (block_m + tail_m)] int32, -1 padded; block_expert [blocks] int32,
    -1 past the end; blocks): pairs grouped by expert in blocks as the module docstring lays
    them out. Pairs with id num_experts (an expert held by another rank) are left out.

    Nothing reads back to the host; blocks is an upper bound from shapes: every non-empty block
    holds at least one pair, and an expert's blocks hold at least its pairs less block_m - 1.
    """
    num_pairs = flat_ids.numel()
    dev = flat_ids.device
    busy = min(num_experts, num_pairs)
    blocks = min(num_pairs, (num_pairs + busy * (block_m - 1)) // block_m)
    stride = block_m + tail_m
    chunks = triton.cdiv(num_pairs, CHUNK)
    e_pad = triton.next_power_of_2(num_experts)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(blocks * stride, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    _count_kernel[(chunks,)](flat_ids, num_pairs, num_experts, counts, CHUNK=CHUNK, E_PAD=e_pad)
    _place_kernel[(max(chunks, triton.cdiv(blocks * stride, CHUNK)),)](
        flat_ids, num_pairs, num_experts, counts, chunks, sorted_pairs, block_expert, blocks,
        CHUNK=CHUNK, E_PAD=e_pad, ROWS=_COUNT_ROWS, BLOCK_M=block_m, TAIL_M=tail_m,
    )  # fmt: skip
    return sorted_pairs, block_expert, blocks
