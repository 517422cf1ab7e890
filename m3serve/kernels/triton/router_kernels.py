"""The router's Triton kernels (the host side, plans and launches: `m3serve.kernels.triton.router`,
whose docstring gives the semantics and the work split): the top-k epilogue, the one-launch GEMV
route, and the tiled logits with their split combine."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _select_store(
    logits,
    tok,
    tok_ok,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    scale,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
):
    """Epilogue on whole rows: logits [BLOCK_T, BLOCK_E] fp32 (all experts) -> k weights, ids."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0)
    # IEEE division (Triton's `/` is approximate for fp32), as in torch's sigmoid.
    scores = tl.math.div_rn(tl.full([BLOCK_T, BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-logits))
    biased = scores + bias[None, :]
    # NaN never equals the row max: as -inf it can still be taken once the numbers run out.
    biased = tl.where(biased == biased, biased, float("-inf"))
    free = tl.broadcast_to(e_ok[None, :], [BLOCK_T, BLOCK_E])

    slot = tl.arange(0, BLOCK_TOPK)
    top_w = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.int32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(TOP_K):
        cand = tl.where(free, biased, float("-inf"))
        best = tl.max(cand, 1)
        # The lowest free id at the max: exact ties resolve the same way every run.
        pick = tl.min(tl.where(free & (cand == best[:, None]), e[None, :], BLOCK_E), 1)
        won = e[None, :] == pick[:, None]
        # One lane survives the mask, so the sum is that score exactly.
        w = tl.sum(tl.where(won, scores, 0.0), 1)
        total += w
        top_w = tl.where(slot[None, :] == j, w[:, None], top_w)
        top_id = tl.where(slot[None, :] == j, pick[:, None], top_id)
        free = free & ~won

    # Normalize first, then scale: the reference's order (route_topk, then the routed scaling).
    weights = tl.math.div_rn(top_w, tl.broadcast_to(total[:, None], [BLOCK_T, BLOCK_TOPK])) * scale
    out_ok = tok_ok[:, None] & (slot[None, :] < TOP_K)
    tok64 = tok.to(tl.int64)
    tl.store(weights_ptr + tok64[:, None] * stride_wt + slot[None, :], weights, mask=out_ok)
    tl.store(ids_ptr + tok64[:, None] * stride_it + slot[None, :], top_id.to(tl.int64), mask=out_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def router_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    logits_ptr,
    arrived_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    hidden,
    num_experts,
    scale,
    stride_xt,
    stride_we,
    stride_lt,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALL_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    EVEN_H: tl.constexpr,
):
    """Program e: the logits of expert e for every token; the last program to finish selects."""
    expert = tl.program_id(0)
    tok = tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    h = tl.arange(0, BLOCK_H)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    w_row = w_ptr + expert.to(tl.int64) * stride_we
    # Products are summed per lane across the steps and over the lanes once at the end.
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        cols = k0 + h
        if EVEN_H:
            w = tl.load(w_row + cols)
            xt = tl.load(x_rows + cols[None, :], mask=tok_ok[:, None], other=0.0)
        else:
            w = tl.load(w_row + cols, mask=cols < hidden, other=0.0)
            x_mask = tok_ok[:, None] & (cols < hidden)[None, :]
            xt = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0)
        acc += xt.to(tl.float32) * w[None, :]
    logits = tl.sum(acc, 1)
    tl.store(logits_ptr + tok * stride_lt + expert, logits, mask=tok_ok)
    # Every thread's store is issued before the arrival, whose release publishes them.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrived_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        e = tl.arange(0, ALL_E)
        ptrs = logits_ptr + tok[:, None] * stride_lt + e[None, :]
        live = tok_ok[:, None] & (e < num_experts)[None, :]
        # Past L1 (.cg): the other programs wrote these from other SMs.
        every = tl.load(ptrs, mask=live, other=0.0, cache_modifier=".cg")
        _select_store(
            every,
            tok,
            tok_ok,
            bias_ptr,
            weights_ptr,
            ids_ptr,
            num_experts,
            scale,
            stride_wt,
            stride_it,
            TOP_K,
            BLOCK_T,
            ALL_E,
            BLOCK_TOPK,
        )
        tl.atomic_xchg(arrived_ptr, 0)  # the next call counts from zero again


@triton.jit(do_not_specialize=["num_tokens"])
def router_logits_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    part_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    hidden,
    num_experts,
    chunk,
    scale,
    stride_xt,
    stride_we,
    stride_ps,
    stride_pt,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    EVEN_K: tl.constexpr,
    FUSED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # let the combine kernel start launching; it waits for this grid on the device
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    tok_ok = tok < num_tokens
    e_ok = e < num_experts
    kk = tl.arange(0, BLOCK_K)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, hidden)
    # int64 rows: a long prefill times H can pass 2**31 elements.
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    w_cols = w_ptr + e[None, :] * stride_we

    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        cols = k0 + kk
        # With H a multiple of BLOCK_K every chunk is whole steps: no column mask, so the loads
        # stay vectorized along H.
        if EVEN_K:
            x_mask = tok_ok[:, None]
            w_mask = e_ok[None, :]
        else:
            x_mask = tok_ok[:, None] & (cols < hi)[None, :]
            w_mask = e_ok[None, :] & (cols < hi)[:, None]
        # Padded token rows and expert columns load no memory and add exact zeros.
        xt = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0).to(tl.float32)
        wt = tl.load(w_cols + cols[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision="ieee")

    if FUSED:
        _select_store(
            acc,
            tok,
            tok_ok,
            bias_ptr,
            weights_ptr,
            ids_ptr,
            num_experts,
            scale,
            stride_wt,
            stride_it,
            TOP_K,
            BLOCK_T,
            BLOCK_E,
            BLOCK_TOPK,
        )
    else:
        part = part_ptr + split.to(tl.int64) * stride_ps + tok.to(tl.int64)[:, None] * stride_pt
        tl.store(part + e[None, :], acc, mask=tok_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def router_combine_kernel(
    part_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    num_splits,
    scale,
    stride_ps,
    stride_pt,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    PDL: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    e = tl.arange(0, BLOCK_E)
    s = tl.arange(0, BLOCK_S)
    if PDL:  # launched early (programmatic dependent launch): the partials are not written yet
        tl.extra.cuda.gdc_wait()
    ptrs = (
        part_ptr
        + s.to(tl.int64)[:, None, None] * stride_ps
        + tok.to(tl.int64)[None, :, None] * stride_pt
        + e[None, None, :]
    )
    live = (
        (s < num_splits)[:, None, None] & tok_ok[None, :, None] & (e < num_experts)[None, None, :]
    )
    # All splits of the tile in one load, summed by one reduction: a fixed order every run, and
    # no chain of dependent loads.
    logits = tl.sum(tl.load(ptrs, mask=live, other=0.0), 0)
    _select_store(
        logits,
        tok,
        tok_ok,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        num_experts,
        scale,
        stride_wt,
        stride_it,
        TOP_K,
        BLOCK_T,
        BLOCK_E,
        BLOCK_TOPK,
    )
