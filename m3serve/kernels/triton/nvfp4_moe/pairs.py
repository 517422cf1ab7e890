"""Which (token, slot) pairs a program of the NVFP4 MoE kernels takes: on the slots route found
in-kernel from the routing ids (the s-th distinct expert present, its pairs in order), on the
sorted route read from the aligned blocks (`align.py`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_expert(
    ids_ptr,
    num_pairs,
    num_experts,
    slot,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SKIPS: tl.constexpr,
):
    """(expert, its pair count) of the slot-th distinct expert present in the ids, ascending;
    count 0 past the last one. With SKIPS, ids >= num_experts (experts another rank holds)
    are left out."""
    pairs = tl.arange(0, P_PAD)
    experts = tl.arange(0, E_PAD)
    if SKIPS:
        raw = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=num_experts).to(tl.int32)
        held = raw < num_experts
        # Padding lanes and skipped ids are binned as id 0 (every value needs a bin): take
        # them back out of bin 0.
        counts = tl.histogram(tl.where(held, raw, 0), E_PAD)
        counts = tl.where(experts == 0, counts - (P_PAD - tl.sum(held.to(tl.int32), 0)), counts)
    else:
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=0).to(tl.int32)
        # Padding lanes read id 0: take them back out of bin 0.
        counts = tl.histogram(ids, E_PAD)
        counts = tl.where(experts == 0, counts - (P_PAD - num_pairs), counts)
    present = (counts > 0).to(tl.int32)
    mine = (present > 0) & (tl.cumsum(present, 0) - 1 == slot)
    return tl.sum(tl.where(mine, experts, 0), 0), tl.sum(tl.where(mine, counts, 0), 0)


@triton.jit
def slot_rows(ids_ptr, num_pairs, expert, first, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pair indices [BLOCK_M] of the expert's pairs number first, first + 1, ... in ascending
    pair order (0 past its last pair). The ids are rescanned in chunks: a [BLOCK_M, P_PAD]
    selection at once would set the register budget of the whole kernel."""
    CHUNK: tl.constexpr = 32 if P_PAD > 32 else P_PAD
    want = first + tl.arange(0, BLOCK_M)
    rows = tl.zeros([BLOCK_M], dtype=tl.int32)
    seen = 0
    for c in tl.static_range(P_PAD // CHUNK):
        pairs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        match = ids == expert
        rank = seen + tl.cumsum(match.to(tl.int32), 0) - 1
        hit = match[None, :] & (rank[None, :] == want[:, None])
        rows += tl.sum(tl.where(hit, pairs[None, :], 0), 1)
        seen += tl.sum(match.to(tl.int32), 0)
    return rows


@triton.jit
def block_pairs(sorted_ptr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """The sorted route's block of this program: (pairs, valid) of its first BLOCK_M positions
    and of the TAIL_M after them, and whether the tail holds a pair (a block is BLOCK_M +
    TAIL_M positions, its expert's pairs first, then -1)."""
    first = tl.program_id(1) * (BLOCK_M + TAIL_M)
    pair = tl.load(sorted_ptr + first + tl.arange(0, BLOCK_M))
    if TAIL_M > 0:
        tail = tl.load(sorted_ptr + first + BLOCK_M + tl.arange(0, TAIL_M))
        has_tail = tl.load(sorted_ptr + first + BLOCK_M) >= 0
    else:
        tail = pair
        has_tail = False
    return tl.maximum(pair, 0), pair >= 0, tl.maximum(tail, 0), tail >= 0, has_tail
