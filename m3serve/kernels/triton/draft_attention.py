"""The DSpark draft's block attention in Triton (Hopper backend): same math as
`m3serve.kernels.draft_attention.draft_attention`, the ground truth.

One program per (request, KV head) holds the request's S block slots × the G query heads of
its KV head as one [BLOCK_S·G_PAD, D] tile (slot-major, G fastest), so each K/V chunk is read
once per GQA group and fed to tl.dot. It walks the request's context pages from the window's
first position to the anchor in chunks of BLOCK_N keys that never straddle a page (each row
masked by its own window), then the block's own S keys, non-causally, with one online softmax
in fp32. Where the context starts and ends is computed in the kernel from the anchor it loads,
and the grid depends on shapes only: no host sync, so the call is CUDA-graph capturable.

Small batches split the context (flash-decoding): B × Hkv programs alone would leave most SMs
idle over a 4095-key window, so each (request, KV head) gets several programs, each over its
share of the context's chunks (the last also over the block's keys); they write unnormalized
partial outputs with their running max and sum, and a small kernel merges the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.triton.attention.config import (
    LOG2E,
    interpreted,
    next_pow2,
    page_chunk,
    sm_count,
)

BLOCK_N = 64  # context keys per inner step (never more than a page)
MAX_SPLITS = 32


@triton.jit(do_not_specialize=["stride_pt"])
def _draft_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kp_ptr,
    vp_ptr,
    table_ptr,
    anchor_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ps,
    stride_ph,
    stride_pvs,
    stride_pvh,
    stride_pt,
    stride_ot,
    stride_oh,
    S: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SB: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CPP: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)
    r = tl.arange(0, BLOCK_S * G_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    slot = r // G_PAD
    gg = r % G_PAD
    heads = h * G + gg
    row_ok = (slot < S) & (gg < G)
    tok = b * S + slot
    anchor = tl.load(anchor_ptr + b).to(tl.int32)
    qpos = anchor + slot
    q = tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    # The context any slot sees: [anchor − window + 1, anchor), clipped at 0 (slot 0 sees it
    # all, later slots a suffix of it).
    lo = tl.maximum(anchor - window + 1, 0)
    first_page = lo // PAGE
    n_pages = tl.where(anchor > 0, (anchor - 1) // PAGE - first_page + 1, 0)
    table_row = table_ptr + b.to(tl.int64) * stride_pt
    acc = tl.zeros([BLOCK_S * G_PAD, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_S * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_S * G_PAD], dtype=tl.float32)
    # This split's share of the (page, chunk) units.
    n_units = n_pages * CPP
    per_split = (n_units + n_splits - 1) // n_splits
    u_lo = sp * per_split
    u_hi = tl.minimum(u_lo + per_split, n_units)
    for u in range(u_lo, u_hi):
        blk = first_page + u // CPP
        page = tl.load(table_row + blk)
        off = (u % CPP) * BLOCK_N + n
        kpos = blk * PAGE + off
        slots = page.to(tl.int64) * PAGE + off
        # slots < 0 on an unmapped page (−1): as a vector test, which the interpreter accepts.
        key_ok = (off < PAGE) & (slots >= 0) & (kpos >= lo) & (kpos < anchor)
        keep = row_ok[:, None] & key_ok[None, :] & (qpos[:, None] - kpos[None, :] < window)
        # other=0: a masked lane must hold a finite value, as P·V multiplies it by p = 0.
        kc = tl.load(
            kp_ptr + slots[:, None] * stride_ps + h * stride_ph + d[None, :],
            mask=key_ok[:, None],
            other=0.0,
        ).to(q.dtype)
        vc = tl.load(
            vp_ptr + slots[:, None] * stride_pvs + h * stride_pvh + d[None, :],
            mask=key_ok[:, None],
            other=0.0,
        ).to(q.dtype)
        s = tl.dot(q, tl.trans(kc), input_precision=PREC) * qk_scale
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vc, input_precision=PREC)
        m_i = m_new

    # The block's own keys: every slot sees all S of them (in the last split).
    j = tl.arange(0, BLOCK_SB)
    # (A scalar-vector `&` of masks is refused by Triton's interpreter: fold it into the bound.)
    j_ok = j < S * (sp == n_splits - 1).to(tl.int32)
    own = (b * S + j).to(tl.int64)
    kb = tl.load(
        k_ptr + own[:, None] * stride_kt + h * stride_kh + d[None, :], mask=j_ok[:, None], other=0.0
    ).to(q.dtype)
    vb = tl.load(
        v_ptr + own[:, None] * stride_vt + h * stride_vh + d[None, :], mask=j_ok[:, None], other=0.0
    ).to(q.dtype)
    s = tl.dot(q, tl.trans(kb), input_precision=PREC) * qk_scale
    s = tl.where(row_ok[:, None] & j_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vb, input_precision=PREC)

    m_i = m_new
    if SPLIT:
        # Partials [B, Hkv, splits, rows, D] and (max, sum) [B, Hkv, splits, 2, rows], fp32.
        rows = BLOCK_S * G_PAD
        unit = ((b * tl.num_programs(1) + h) * n_splits + sp).to(tl.int64)
        tl.store(part_ptr + unit * (rows * D) + r[:, None] * D + d[None, :], acc)
        tl.store(stats_ptr + unit * (2 * rows) + r, m_i)
        tl.store(stats_ptr + unit * (2 * rows) + rows + r, l_i)
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )  # fmt: skip


@triton.jit(do_not_specialize=["n_splits"])
def _merge_kernel(
    part_ptr,
    stats_ptr,
    out_ptr,
    n_splits,
    stride_ot,
    stride_oh,
    S: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
):
    """out = the splits' partials combined by their log-sum-exp (scores are in log2 units)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = BLOCK_S * G_PAD
    r = tl.arange(0, BLOCK_S * G_PAD)
    d = tl.arange(0, D)
    slot = r // G_PAD
    gg = r % G_PAD
    row_ok = (slot < S) & (gg < G)
    acc = tl.zeros([BLOCK_S * G_PAD, D], dtype=tl.float32)
    m = tl.full([BLOCK_S * G_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_S * G_PAD], dtype=tl.float32)
    for sp in range(0, n_splits):
        unit = ((b * tl.num_programs(1) + h) * n_splits + sp).to(tl.int64)
        m_s = tl.load(stats_ptr + unit * (2 * rows) + r)
        l_s = tl.load(stats_ptr + unit * (2 * rows) + rows + r)
        part = tl.load(part_ptr + unit * (rows * D) + r[:, None] * D + d[None, :])
        m_new = tl.maximum(m, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        beta = tl.exp2(m_s - m_use)
        acc = acc * alpha[:, None] + part * beta[:, None]
        total = total * alpha + l_s * beta
        m = m_new
    o = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tok = b * S + slot
    heads = h * G + gg
    tl.store(
        out_ptr + tok[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def draft_num_splits(
    batch: int, num_kv_heads: int, max_units: int, device: torch.device, programs_per_sm: int = 2
) -> int:
    """Splits per (request, KV head): a function of shapes only (so graph buckets keep theirs).
    Enough programs for `programs_per_sm` per SM, a power of two, at most one per work unit;
    1 in the interpreter, which runs programs one by one."""
    if device.type != "cuda":
        return 1
    wanted = -(-programs_per_sm * sm_count(device.index or 0) // max(batch * num_kv_heads, 1))
    return max(1, min(next_pow2(wanted), MAX_SPLITS, max_units))


def draft_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    anchor_pos: torch.Tensor,
    page_size: int,
    window: int,
    scale: float,
    num_splits: int = 0,
) -> torch.Tensor:
    """q [B·S, Hq, D], the block's own k/v [B·S, Hkv, D]; k_pool/v_pool [slots, Hkv, D] (bf16,
    fp32 or fp8_e4m3fn); page_table [B, P] int32 (−1 padded); anchor_pos [B] int (device)
    -> [B·S, Hq, D] in q's dtype. `num_splits` 0: from the shapes (`draft_num_splits`).
    No host synchronization."""
    batch = anchor_pos.shape[0]
    rows, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    if batch == 0 or rows % batch or num_heads % num_kv or k_pool.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and the pool {tuple(k_pool.shape)} "
            f"do not fit {batch} blocks"
        )
    if head_dim != next_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two ≥ 16, got {head_dim}")
    tensors = (q, k, v, k_pool, v_pool)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v and the pools need a contiguous last dimension")
    block, group = rows // batch, num_heads // num_kv
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    out = torch.empty_like(q)
    group_pad = next_pow2(group)
    # ≥ 16 rows and ≥ 16 block keys, so every tl.dot dimension compiles on the GPU.
    block_s = max(next_pow2(block), -(-16 // group_pad))
    block_n = page_chunk(page_size, BLOCK_N)
    dot_f32 = q.dtype == torch.float32 or interpreted(q)
    # A [128, D] fp32 accumulator (the real model's 8 slots × 16 heads) needs 8 warps' registers.
    warps = 8 if block_s * group_pad >= 128 else 4
    # Context chunks a request can have: its window's, or its page table's if narrower.
    max_units = -(-min(window - 1, table.shape[1] * page_size) // block_n) + 1
    splits = num_splits or draft_num_splits(batch, num_kv, max_units, q.device)
    rows_pad = block_s * group_pad
    if splits > 1:
        part = torch.empty(batch, num_kv, splits, rows_pad, head_dim, device=q.device)
        stats = torch.empty(batch, num_kv, splits, 2, rows_pad, device=q.device)
    else:
        part = stats = out  # never written
    _draft_attention_kernel[(batch, num_kv, splits)](
        q, k, v, k_pool, v_pool, table, anchor_pos, out, part, stats, window,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), table.stride(0),
        out.stride(0), out.stride(1),
        S=block, G=group, G_PAD=group_pad, BLOCK_S=block_s, BLOCK_SB=max(16, next_pow2(block)),
        D=head_dim, PAGE=page_size, BLOCK_N=block_n, CPP=-(-page_size // block_n),
        DOT_F32=dot_f32, PREC="ieee" if dot_f32 else "tf32", SPLIT=splits > 1,
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, num_kv)](
            part, stats, out, splits, out.stride(0), out.stride(1),
            S=block, G=group, G_PAD=group_pad, BLOCK_S=block_s, D=head_dim, num_warps=warps,
        )  # fmt: skip
    return out
