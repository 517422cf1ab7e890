"""Decode / verify path: split-K flash-decoding over each token's selected pages (or, for dense
layers, all its pages), then a log-sum-exp merge of the splits. See the package docstring."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.triton.attention.config import (
    DEFAULT_CONFIG,
    AttentionConfig,
    next_pow2,
    page_chunk,
    pdl_supported,
    sm_count,
)
from m3serve.kernels.triton.launches import launch

# The online-softmax step is written out in both attention kernels rather than shared through a
# @triton.jit helper: Triton's interpreter re-patches triton.language on every helper call
# (~5 ms), which per loop iteration would dominate the CPU test run.


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_pt"])
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


@triton.jit(do_not_specialize=["num_splits"])
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
    sms = sm_count(device.index or 0) if device.type == "cuda" else 1
    wanted = -(-config.programs_per_sm * sms // max(num_tokens * num_kv_heads, 1))
    return max(1, min(next_pow2(wanted), config.max_splits, units_per_token))


def launch_decode(
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
    block_n = page_chunk(page_size, cfg.decode_block_n)
    chunks_per_page = -(-page_size // block_n)
    pages_per_token = topk if common["SPARSE"] else table.shape[1]
    splits = decode_num_splits(
        num_tokens, num_kv_heads, pages_per_token * chunks_per_page, q.device, cfg
    )
    direct = splits == 1
    pdl = cfg.decode_pdl and not direct and pdl_supported(q)
    if direct:
        part_o = part_lse = out  # unused: the split kernel normalizes and writes out itself
    else:
        part_o = torch.empty(
            num_tokens, num_q_heads, splits, head_dim, device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty(
            num_tokens, num_q_heads, splits, device=q.device, dtype=torch.float32
        )
    launch(
        _decode_split_kernel, (num_tokens, num_kv_heads, splits),
        q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
        part_o, part_lse, num_reqs, num_q_heads, splits, topk, heads_per_idx,
        G=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, CPP=chunks_per_page,
        DIRECT=direct, PDL=pdl, num_warps=cfg.decode_num_warps,
        num_stages=cfg.decode_num_stages, **common,
    )  # fmt: skip
    if not direct:
        launch(
            _decode_merge_kernel, (num_tokens, num_q_heads),
            part_o, part_lse, out, num_q_heads, splits, out.stride(0), out.stride(1),
            D=head_dim, BLOCK_S=max(2, next_pow2(splits)), PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
