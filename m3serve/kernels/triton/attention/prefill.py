"""Prefill path: varlen flash-attention over tiles of consecutive new tokens, with a planning
kernel that lists each sparse tile's distinct selected pages. See the package docstring."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.triton.attention.config import AttentionConfig, next_pow2, page_chunk
from m3serve.kernels.triton.launches import launch

# The online-softmax step is written out in both attention kernels rather than shared through a
# @triton.jit helper: Triton's interpreter re-patches triton.language on every helper call
# (~5 ms), which per loop iteration would dominate the CPU test run.


@triton.jit
def _tile_counts(starts_ptr, first_req, num_reqs, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    """Per request of the batch: (row start, row end, tiles); requests before `first_req` (a
    mixed step's decode rows, which the decode kernel takes) have none."""
    rb = tl.arange(0, BLOCK_B)
    live = rb < num_reqs
    lo = tl.load(starts_ptr + rb, mask=live, other=0)
    hi = tl.load(starts_ptr + rb + 1, mask=live, other=0)
    n_tiles = tl.where(rb >= first_req, (hi - lo + BLOCK_T - 1) // BLOCK_T, 0)
    return lo, hi, n_tiles


@triton.jit
def _locate_tile(
    tile, starts_ptr, first_req, num_reqs, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr
):  # fmt: skip
    """Tile `tile` of the batch (tiles numbered request by request from `first_req`) ->
    (exists, request, first row, end row of the request)."""
    rb = tl.arange(0, BLOCK_B)
    live = rb < num_reqs
    lo, hi, n_tiles = _tile_counts(starts_ptr, first_req, num_reqs, BLOCK_T, BLOCK_B)
    tiles_end = tl.cumsum(n_tiles, 0)
    # The owner is the first request whose tiles end after `tile` (cumulative ends are sorted).
    req = tl.sum(((tiles_end <= tile) & live).to(tl.int32), 0)
    mine = rb == req
    first_tile = tl.sum(tl.where(mine, tiles_end - n_tiles, 0), 0)
    req_lo = tl.sum(tl.where(mine, lo, 0), 0)
    req_hi = tl.sum(tl.where(mine, hi, 0), 0)
    exists = tile < tl.sum(n_tiles, 0)
    return exists, req, req_lo + (tile - first_tile) * BLOCK_T, req_hi


@triton.jit(do_not_specialize=["first_req", "num_reqs"])
def _prefill_plan_kernel(
    ids_ptr,
    starts_ptr,
    plan_ptr,
    count_ptr,
    first_req,
    num_reqs,
    topk,
    stride_it,
    stride_ih,
    BLOCK_T: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The distinct pages a tile's tokens selected (for one index head), as a compact list.

    Entries are kept in first-seen order; -1 padding and repeats across tokens are dropped.
    """
    tile = tl.program_id(0)
    idx_head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    _, _, tok0, req_hi = _locate_tile(tile, starts_ptr, first_req, num_reqs, BLOCK_T, BLOCK_B)
    i = tl.arange(0, BLOCK_T * K_PAD)
    tok = tok0 + i // K_PAD
    entry = i % K_PAD
    # A tile past the batch's last one gets req_hi 0 and tok ≥ 0, so it loads nothing and
    # records an empty list.
    ok = (tok < req_hi) & (entry < topk)
    ptrs = ids_ptr + tok.to(tl.int64) * stride_it + idx_head * stride_ih + entry
    cand = tl.load(ptrs, mask=ok, other=-1)
    # Same values loaded twice so the pairwise compare needs no register transpose.
    cand_j = tl.load(ptrs, mask=ok, other=-1)
    earlier = (cand[:, None] == cand_j[None, :]) & (i[None, :] < i[:, None])
    dup = tl.max(earlier.to(tl.int32), 1)
    keep = (cand >= 0) & (dup == 0)
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    base = (tile * n_heads + idx_head).to(tl.int64)
    tl.store(plan_ptr + base * (BLOCK_T * K_PAD) + slot, cand, mask=keep)
    tl.store(count_ptr + base, tl.sum(keep.to(tl.int32), 0))


@triton.jit(do_not_specialize=["first_req", "num_reqs", "stride_pt"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    starts_ptr,
    pos_ptr,
    ids_ptr,
    plan_ptr,
    count_ptr,
    out_ptr,
    first_req,
    num_reqs,
    num_idx_heads,
    topk,
    heads_per_idx,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_it,
    stride_ih,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CPP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPARSE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    h = tl.program_id(1)
    # Launch the batch's last tiles first: within a request they see the most keys, and
    # starting the long programs early shortens the tail of the grid.
    _, _, n_tiles = _tile_counts(starts_ptr, first_req, num_reqs, BLOCK_T, BLOCK_B)
    tile = tl.sum(n_tiles, 0) - 1 - tl.program_id(0)
    if tile < 0:
        return
    _, req, tok0, req_hi = _locate_tile(tile, starts_ptr, first_req, num_reqs, BLOCK_T, BLOCK_B)
    seq_len = tl.load(seq_lens_ptr + req)

    r = tl.arange(0, BLOCK_T * G_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    tok = tok0 + r // G_PAD
    gg = r % G_PAD
    heads = h * G + gg
    row_ok = (gg < G) & (tok < req_hi)
    # Padding rows get position -1 so the causal test rejects every key for them.
    qpos = tl.load(pos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    max_pos = tl.max(qpos, 0)
    q = tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    table_row = page_table_ptr + req.to(tl.int64) * stride_pt
    k_head = h * stride_kh
    v_head = h * stride_vh

    if SPARSE:
        idx_head = (h * G) // heads_per_idx
        kk = tl.arange(0, K_PAD)
        # Each row's own selection, to mask the tile-wide page union per row.
        row_ids = tl.load(
            ids_ptr + tok[:, None].to(tl.int64) * stride_it + idx_head * stride_ih + kk[None, :],
            mask=row_ok[:, None] & (kk < topk)[None, :],
            other=-1,
        )
        plan_row = plan_ptr + (tile * num_idx_heads + idx_head).to(tl.int64) * (BLOCK_T * K_PAD)
        n_units = tl.load(count_ptr + tile * num_idx_heads + idx_head) * CPP
    else:
        n_units = (max_pos // PAGE) * CPP + (max_pos % PAGE) // BLOCK_N + 1

    acc = tl.zeros([BLOCK_T * G_PAD, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_T * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * G_PAD], dtype=tl.float32)
    # One flat loop over (page, chunk) units, with no data-dependent branch, so Triton can
    # software-pipeline the K/V loads. Sparse: the pages of the tile's plan; dense: every page
    # up to the tile's last position.
    for u in range(0, n_units):
        if SPARSE:
            blk = tl.load(plan_row + u // CPP)
            keep_row = tl.max((row_ids == blk).to(tl.int32), 1) > 0
        else:
            blk = u // CPP
            keep_row = row_ok
        page = tl.load(table_row + blk)
        off = (u % CPP) * BLOCK_N + n
        kpos = blk * PAGE + off
        slots = page.to(tl.int64) * PAGE + off
        key_ok = (off < PAGE) & (slots >= 0) & (kpos <= max_pos) & (kpos < seq_len)
        keep = keep_row[:, None] & key_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        # other=0: a masked lane must hold a finite value, as P·V multiplies it by p = 0.
        k_ptrs = k_ptr + slots[:, None] * stride_ks + k_head + d[None, :]
        v_ptrs = v_ptr + slots[:, None] * stride_vs + v_head + d[None, :]
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    positions: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    num_reqs: int,
    group: int,
    topk: int,
    heads_per_idx: int,
    num_idx_heads: int,
    max_extend: int,
    cfg: AttentionConfig,
    common: dict,
    first_req: int = 0,
) -> None:
    """Tiles over the rows of requests [first_req, num_reqs) (the decode kernel takes the rows
    of the ones before: a mixed step's decode rows)."""
    num_tokens, num_q_heads, _ = q.shape
    num_tokens -= first_req  # the requests before have one row each
    live_reqs = num_reqs - first_req
    num_kv_heads = num_q_heads // group
    page_size = common["PAGE"]
    group_pad = next_pow2(group)
    # Tokens per tile: the configured row budget, no more than the longest request needs, and
    # enough rows (≥ 16) for tl.dot.
    block_t = min(max(cfg.prefill_block_m // group_pad, 1), next_pow2(max_extend))
    block_t = max(block_t, -(-16 // group_pad))
    block_n = page_chunk(page_size, cfg.prefill_block_n)
    # Each request adds at most one partial tile, so this bounds the live tiles by shapes alone.
    max_tiles = min(-(-num_tokens // block_t) + live_reqs, live_reqs * -(-max_extend // block_t))
    k_pad = next_pow2(topk)
    if common["SPARSE"]:
        plan = torch.empty(
            max_tiles, num_idx_heads, block_t * k_pad, device=q.device, dtype=torch.int32
        )
        counts = torch.empty(max_tiles, num_idx_heads, device=q.device, dtype=torch.int32)
        launch(
            _prefill_plan_kernel, (max_tiles, num_idx_heads),
            ids, extend_starts, plan, counts, first_req, num_reqs, topk, ids.stride(0),
            ids.stride(1),
            BLOCK_T=block_t, K_PAD=k_pad, BLOCK_B=common["BLOCK_B"], num_warps=4,
        )  # fmt: skip
    else:
        plan = counts = table  # unused in dense mode
    launch(
        _prefill_kernel, (max_tiles, num_kv_heads),
        q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, plan, counts, out,
        first_req, num_reqs, num_idx_heads, topk, heads_per_idx,
        G=group, G_PAD=group_pad, BLOCK_T=block_t, BLOCK_N=block_n,
        CPP=-(-page_size // block_n), K_PAD=k_pad,
        num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages, **common,
    )  # fmt: skip
