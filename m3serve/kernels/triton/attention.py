"""Paged attention over the KV cache, dense-causal or block-sparse, in Triton (Hopper backend).

Same math as `m3serve.kernels.attention.paged_attention` (the ground truth): for each new token
and query head, softmax(q·k·scale) over the keys that are (a) at or before the token's position,
(b) inside the request (key < seq_len) and (c) for sparse layers, in one of the logical pages the
token's index head selected. Scores, softmax and the accumulator are fp32; K/V are bf16 or
float8_e4m3fn (scale 1.0, dequantized on load) and the P·V product runs in q's dtype.

Two paths, picked from `max_extend` (a host int the batch already carries, so no sync):

* decode / verify (every request has ≤ 16 new tokens): split-K flash-decoding. The grid is
  (token, KV head, split) and one program handles the G query heads of its KV head as one
  [G, D] tile (so K/V are read once per GQA group and tl.dot can be used) over its share of the
  token's keys: a share of its K selected pages, or for dense layers a share of all pages up to
  its position. Partial O and log-sum-exp go to scratch buffers and a second small kernel merges
  the splits. The grid and split count depend on shapes only (no host sync, no data-dependent
  sizes), so the call is CUDA-graph capturable; how the keys divide between splits is computed
  in the kernel from the live positions.
* prefill (any extend length): varlen flash-attention. A tile is BLOCK_T consecutive new tokens
  of one request × the G query heads of one KV head (BLOCK_T·G rows, G fastest), so a K/V chunk
  is shared by the whole GQA group. Dense tiles walk every page up to the tile's last position
  with a per-row causal mask. Sparse tiles walk the union of their tokens' selected pages: a
  small planning kernel dedupes the tile's BLOCK_T·K selection entries into a compact page list
  once per (tile, index head), and each row is masked by its own token's selection and causality.
  The main loops have no data-dependent branches, so Triton can software-pipeline their loads.

Pages are walked in chunks of BLOCK_N keys that never straddle a page; when a page is smaller
than BLOCK_N (tiny test shapes) the chunk's tail is masked off, which keeps every tl.dot
dimension ≥ 16 on the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import triton
import triton.language as tl

# softmax runs on exp2: scores are pre-multiplied by log2(e) so exp2(s - m) == exp(s' - m').
_LOG2E = 1.4426950408889634

# Requests with at most this many new tokens per step take the split-K decode path.
DECODE_MAX_EXTEND = 16


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters. The defaults target an H200 at the model's shapes (D 128, page 128)."""

    path: Literal["auto", "decode", "prefill"] = "auto"
    decode_block_n: int = 64  # keys per inner step of a split
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    num_splits: int = 0  # 0: derive from shapes so the grid covers programs_per_sm × SMs
    programs_per_sm: int = 2
    max_splits: int = 64
    prefill_block_m: int = 128  # rows per tile = tokens × padded GQA group
    prefill_block_n: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    # Programmatic dependent launch (sm_90+): the merge kernel is launched while the split
    # kernel still runs and waits on the device, hiding one launch latency per call.
    decode_pdl: bool = True


DEFAULT_CONFIG = AttentionConfig()


# --------------------------------------------------------------------------------- kernels
# The online-softmax step is written out in both attention kernels rather than shared through a
# @triton.jit helper: Triton's interpreter re-patches triton.language on every helper call
# (~5 ms), which per loop iteration would dominate the CPU test run.


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    starts_ptr,
    pos_ptr,
    ids_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_reqs,
    num_q_heads,
    num_splits,
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
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CPP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPARSE: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # let the merge kernel start launching now; it waits for this grid on the device
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    # The request of token t: requests are contiguous row ranges, so count those ending by t.
    rb = tl.arange(0, BLOCK_B)
    ends = tl.load(starts_ptr + 1 + rb, mask=rb < num_reqs, other=0)
    req = tl.sum(((ends <= t) & (rb < num_reqs)).to(tl.int32), 0)
    seq_len = tl.load(seq_lens_ptr + req)
    qpos = tl.load(pos_ptr + t).to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = h * G + g
    row_ok = g < G
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    k_head = h * stride_kh
    v_head = h * stride_vh

    # Work units are (page, chunk of BLOCK_N keys inside it); splits take contiguous shares.
    # (Statement-level constexpr branches: only the taken side is compiled.)
    if SPARSE:  # noqa: SIM108
        n_units = topk * CPP
    else:
        n_units = (qpos // PAGE) * CPP + (qpos % PAGE) // BLOCK_N + 1
    per_split = tl.cdiv(n_units, num_splits)
    u_lo = split * per_split
    u_hi = tl.minimum(u_lo + per_split, n_units)
    idx_head = (h * G) // heads_per_idx
    ids_row = ids_ptr + t * stride_it + idx_head * stride_ih
    table_row = page_table_ptr + req.to(tl.int64) * stride_pt

    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for u in range(u_lo, u_hi):
        if SPARSE:  # noqa: SIM108
            blk = tl.load(ids_row + u // CPP)
        else:
            blk = u // CPP
        page = tl.load(table_row + blk, mask=blk >= 0, other=-1)
        off = (u % CPP) * BLOCK_N + n
        kpos = blk * PAGE + off
        slots = page.to(tl.int64) * PAGE + off
        # With off < PAGE, kpos < 0 means a -1 (padding) entry and slots < 0 an unmapped page.
        # Tested on the vectors, not on blk/page: the interpreter rejects a load mask that ANDs
        # a scalar into a vector.
        key_ok = (off < PAGE) & (kpos >= 0) & (slots >= 0) & (kpos <= qpos) & (kpos < seq_len)
        # Masked lanes issue no memory traffic: padding entries and keys past the token cost
        # nothing but their share of the (tiny) dot.
        # other=0: a masked lane must hold a finite value, as P·V multiplies it by p = 0.
        k_ptrs = k_ptr + slots[:, None] * stride_ks + k_head + d[None, :]
        v_ptrs = v_ptr + slots[:, None] * stride_vs + v_head + d[None, :]
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        # fp8 -> bf16 is exact (E4M3 fits bf16's exponent and mantissa): this is the dequant.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        # Online softmax in log2 units. A row with no allowed key yet keeps m = -inf; using 0 in
        # its place avoids inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(
            out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part_row = (t * num_q_heads + heads).to(tl.int64) * num_splits + split
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_o_ptr + part_row[:, None] * D + d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    if PDL:  # launched early (programmatic dependent launch): the partials are not written yet
        tl.extra.cuda.gdc_wait()
    rows = (t * num_q_heads + head).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + rows, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    # A token with no allowed key at all (all splits empty) merges to zeros, not NaN.
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    denom = tl.sum(w, 0)
    o = tl.load(
        part_o_ptr + rows[:, None] * D + d[None, :], mask=(s < num_splits)[:, None], other=0.0
    )
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _locate_tile(
    tile, starts_ptr, num_reqs, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr
):  # fmt: skip
    """Tile `tile` of the batch (tiles numbered request by request) -> (exists, request, first
    row, end row of the request)."""
    rb = tl.arange(0, BLOCK_B)
    live = rb < num_reqs
    lo = tl.load(starts_ptr + rb, mask=live, other=0)
    hi = tl.load(starts_ptr + rb + 1, mask=live, other=0)
    n_tiles = (hi - lo + BLOCK_T - 1) // BLOCK_T
    tiles_end = tl.cumsum(n_tiles, 0)
    # The owner is the first request whose tiles end after `tile` (cumulative ends are sorted).
    req = tl.sum(((tiles_end <= tile) & live).to(tl.int32), 0)
    mine = rb == req
    first_tile = tl.sum(tl.where(mine, tiles_end - n_tiles, 0), 0)
    req_lo = tl.sum(tl.where(mine, lo, 0), 0)
    req_hi = tl.sum(tl.where(mine, hi, 0), 0)
    exists = tile < tl.sum(n_tiles, 0)
    return exists, req, req_lo + (tile - first_tile) * BLOCK_T, req_hi


@triton.jit
def _prefill_plan_kernel(
    ids_ptr,
    starts_ptr,
    plan_ptr,
    count_ptr,
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
    _, _, tok0, req_hi = _locate_tile(tile, starts_ptr, num_reqs, BLOCK_T, BLOCK_B)
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


@triton.jit
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
    rb = tl.arange(0, BLOCK_B)
    lo_all = tl.load(starts_ptr + rb, mask=rb < num_reqs, other=0)
    hi_all = tl.load(starts_ptr + rb + 1, mask=rb < num_reqs, other=0)
    total = tl.sum((hi_all - lo_all + BLOCK_T - 1) // BLOCK_T, 0)
    tile = total - 1 - tl.program_id(0)
    if tile < 0:
        return
    _, req, tok0, req_hi = _locate_tile(tile, starts_ptr, num_reqs, BLOCK_T, BLOCK_B)
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


# --------------------------------------------------------------------------------- wrapper


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


@cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl_supported(t: torch.Tensor) -> bool:
    return not _interpreted(t) and _sm90(t.device.index or 0)


def decode_num_splits(
    num_tokens: int,
    num_kv_heads: int,
    units_per_token: int,
    device: torch.device,
    config: AttentionConfig = DEFAULT_CONFIG,
) -> int:
    """Splits per (token, KV head) for the decode path: a function of shapes only.

    Enough programs to give every SM `programs_per_sm` of them, a power of two (so batch buckets
    share compiled merge kernels), never more than there are work units to share out.
    """
    if config.num_splits > 0:
        return config.num_splits
    # The interpreter runs programs one by one: a token-sized grid is the fastest there.
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
    wanted = -(-config.programs_per_sm * sms // max(num_tokens * num_kv_heads, 1))
    return max(1, min(_pow2(wanted), config.max_splits, units_per_token))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    scale: float,
    block_ids: torch.Tensor | None,
    max_extend: int,
    out: torch.Tensor | None = None,
    *,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over their requests' paged KV (already written).

    q [T, Hq, D] (bf16 or fp32); k_cache/v_cache [slots, Hkv, D] (bf16, fp32 or fp8_e4m3fn);
    page_table [B, max_pages] int32 (-1 padded); seq_lens [B] int32 tokens in the cache;
    extend_starts [B + 1] int32, request b owning rows [s[b], s[b+1]); positions [T] int64;
    block_ids [T, H_idx, K] int32 logical pages (-1 padded) or None for dense causal attention;
    max_extend the longest extend length in the batch (host int, picks the path).
    Returns out (allocated when None) [T, Hq, D] in q's dtype. No host synchronization.
    """
    cfg = config or DEFAULT_CONFIG
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if num_q_heads % num_kv_heads or k_cache.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the KV cache {tuple(k_cache.shape)}")
    if head_dim != _pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two ≥ 16, got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV caches need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dimension")
    if num_tokens == 0:
        return out

    sparse = block_ids is not None
    if sparse:
        if block_ids.shape[0] != num_tokens or block_ids.shape[2] < 1:
            raise ValueError(f"block_ids {tuple(block_ids.shape)} for {num_tokens} tokens")
        num_idx_heads, topk = block_ids.shape[1], block_ids.shape[2]
        heads_per_idx = num_q_heads // num_idx_heads
        # One selection per GQA group: all G heads that share K/V tiles share a page list.
        if num_q_heads % num_idx_heads or heads_per_idx % group:
            raise ValueError(f"{num_idx_heads} index heads must divide the {num_kv_heads} KV heads")
        ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    else:
        num_idx_heads, topk, heads_per_idx = 1, 1, num_q_heads
        ids = page_table  # never read; any int32 tensor keeps the signature uniform
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    num_reqs = table.shape[0]

    interp = _interpreted(q)
    # The interpreter's bf16 tl.dot multiplies raw bit patterns, so it computes in fp32 there.
    dot_f32 = q.dtype == torch.float32 or interp
    common = dict(
        qk_scale=float(scale) * _LOG2E,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ks=k_cache.stride(0),
        stride_kh=k_cache.stride(1),
        stride_vs=v_cache.stride(0),
        stride_vh=v_cache.stride(1),
        stride_pt=table.stride(0),
        stride_it=ids.stride(0),
        stride_ih=ids.stride(1),
        D=head_dim,
        PAGE=page_size,
        BLOCK_B=max(2, _pow2(num_reqs)),
        SPARSE=sparse,
        DOT_F32=dot_f32,
        PREC="ieee" if dot_f32 else "tf32",
    )
    if cfg.path == "decode" or (cfg.path == "auto" and max_extend <= DECODE_MAX_EXTEND):
        _decode(q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
                num_reqs, group, topk, heads_per_idx, cfg, common)  # fmt: skip
    else:
        _prefill(q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
                 num_reqs, group, topk, heads_per_idx, num_idx_heads, max_extend, cfg,
                 common)  # fmt: skip
    return out


def _block_n(page_size: int, wanted: int) -> int:
    # Never straddle a page; at least 16 so every tl.dot dimension compiles on the GPU.
    return max(16, min(_pow2(wanted), _pow2(page_size)))


def _decode(
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
    cfg: AttentionConfig,
    common: dict,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = num_q_heads // group
    page_size = common["PAGE"]
    block_n = _block_n(page_size, cfg.decode_block_n)
    chunks_per_page = -(-page_size // block_n)
    pages_per_token = topk if common["SPARSE"] else table.shape[1]
    splits = decode_num_splits(
        num_tokens, num_kv_heads, pages_per_token * chunks_per_page, q.device, cfg
    )
    direct = splits == 1
    pdl = cfg.decode_pdl and not direct and _pdl_supported(q)
    if direct:
        part_o = part_lse = out  # unused: the split kernel normalizes and writes out itself
    else:
        part_o = torch.empty(
            num_tokens, num_q_heads, splits, head_dim, device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty(
            num_tokens, num_q_heads, splits, device=q.device, dtype=torch.float32
        )
    _decode_split_kernel[(num_tokens, num_kv_heads, splits)](
        q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
        part_o, part_lse, num_reqs, num_q_heads, splits, topk, heads_per_idx,
        G=group, BLOCK_G=max(16, _pow2(group)), BLOCK_N=block_n, CPP=chunks_per_page,
        DIRECT=direct, PDL=pdl, num_warps=cfg.decode_num_warps,
        num_stages=cfg.decode_num_stages, **common,
    )  # fmt: skip
    if not direct:
        _decode_merge_kernel[(num_tokens, num_q_heads)](
            part_o, part_lse, out, num_q_heads, splits, out.stride(0), out.stride(1),
            D=head_dim, BLOCK_S=max(2, _pow2(splits)), PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip


def _prefill(
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
) -> None:
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = num_q_heads // group
    page_size = common["PAGE"]
    group_pad = _pow2(group)
    # Tokens per tile: the configured row budget, no more than the longest request needs, and
    # enough rows (≥ 16) for tl.dot.
    block_t = min(max(cfg.prefill_block_m // group_pad, 1), _pow2(max_extend))
    block_t = max(block_t, -(-16 // group_pad))
    block_n = _block_n(page_size, cfg.prefill_block_n)
    # Each request adds at most one partial tile, so this bounds the live tiles by shapes alone.
    max_tiles = min(-(-num_tokens // block_t) + num_reqs, num_reqs * -(-max_extend // block_t))
    k_pad = _pow2(topk)
    if common["SPARSE"]:
        plan = torch.empty(
            max_tiles, num_idx_heads, block_t * k_pad, device=q.device, dtype=torch.int32
        )
        counts = torch.empty(max_tiles, num_idx_heads, device=q.device, dtype=torch.int32)
        _prefill_plan_kernel[(max_tiles, num_idx_heads)](
            ids, extend_starts, plan, counts, num_reqs, topk, ids.stride(0), ids.stride(1),
            BLOCK_T=block_t, K_PAD=k_pad, BLOCK_B=common["BLOCK_B"], num_warps=4,
        )  # fmt: skip
    else:
        plan = counts = table  # unused in dense mode
    _prefill_kernel[(max_tiles, num_kv_heads)](
        q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, plan, counts, out,
        num_reqs, num_idx_heads, topk, heads_per_idx,
        G=group, G_PAD=group_pad, BLOCK_T=block_t, BLOCK_N=block_n,
        CPP=-(-page_size // block_n), K_PAD=k_pad,
        num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages, **common,
    )  # fmt: skip
