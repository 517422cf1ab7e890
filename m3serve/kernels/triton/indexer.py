"""MSA lightning indexer on paged index-K in Triton: page-max block scores, then block top-k.

Two kernels, both launched on grids that depend only on tensor shapes (CUDA-graph capturable, no
host sync); every piece of per-request metadata is read on the device.

`block_scores` -> [T, H_idx, max_blocks] fp32. A program owns a tile of consecutive query tokens
of one request (all index heads of each token) and a chunk of that request's logical pages. It
loads its queries once and streams the chunk's pages through the page table, one page per step,
as a [tokens*heads, Di] x [Di, page] dot, so every index-K row is read once for all heads and
tokens of the tile. The key stream is the whole cost at long context (decode is bandwidth-bound
on index-K), which is why the heads share the load and why pages in the tile's future are never
loaded. Score = max over the page's keys at positions <= the query's position of q.k (fp32
accumulate, no scale); pages wholly in the query's future or beyond the request are -inf.

`select_blocks` -> [T, H_idx, topk] int32. A program holds whole (token, head) rows in registers:
one row of up to 8192 blocks (1M tokens), or several short rows. Scores map to order-preserving
uint32 keys, forced blocks (local, init) get the largest key, -inf gets 0; a 16-step search, two
bits a step, finds the k-th largest key (the threshold), then blocks above it and the lowest-id
blocks equal to it fill exactly k slots. Output: ascending block ids, -1 padding, no duplicates.
Ties at the threshold go to the lower block id, so the result is deterministic.

Index-K may be bf16, fp16, fp32 or float8_e4m3fn (scale 1.0: dequantized by a cast, which is
exact into bf16/fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.triton.launches import launch

# Pages a program streams at least, to amortize its prologue (tile lookup, q load). A prefill
# tile's queries (up to 128 rows) are as many bytes as a page of keys: two pages. A decode
# tile's (16 rows) are an eighth of a page, and one page a program, twice the programs, scored
# 1.0-1.5 µs faster at batch 1-8 and 1K-16K of context (5.1 -> 3.6 µs at batch 1, 4K; an H100,
# 2026-12-07), never slower up to 64K.
_MIN_PAGES_PER_PROGRAM = 2
_MIN_PAGES_PER_DECODE_PROGRAM = 1
# Score programs to aim for: several per SM (132 on an H200), so that enough page loads are in
# flight to saturate HBM even when one request's tile is the whole batch (decode at batch 1).
_TARGET_PROGRAMS = 1024
# Rows of the score dot: tl.dot needs >= 16; 128 keeps a prefill tile's fp32 scores in registers.
_MIN_ROWS = 16
_MAX_ROWS = 128

# Top-k: elements a program holds when packing short rows, and programs to keep on an H200.
_TOPK_ELEMENTS = 2048
_TOPK_MIN_PROGRAMS = 264

_KEY_TYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "num_reqs",
        "max_blocks",
        "pages_per_prog",
        "stride_ptb",
        "stride_ot",
        "stride_oh",
    ]
)
def _block_scores_kernel(
    q_ptr,
    k_ptr,
    page_table_ptr,
    seq_lens_ptr,
    ext_starts_ptr,
    pos_ptr,
    out_ptr,
    num_tokens,
    num_reqs,
    num_heads,
    head_dim,
    max_blocks,
    pages_per_prog,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kd,
    stride_ptb,
    stride_ptp,
    stride_ot,
    stride_oh,
    stride_ob,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    Q_TO_F16: tl.constexpr,
):
    pid_tile = tl.program_id(0)
    pid_chunk = tl.program_id(1)

    # Map the flat tile id to (request, tile within it). Request r owns rows [lo_r, hi_r) and
    # cdiv(hi_r - lo_r, BLOCK_T) tiles; a pseudo-request r == num_reqs owns the rows after the
    # last request (CUDA-graph padding) so that every output row is written. Computed from
    # extend_starts on the device: the grid never depends on per-request lengths.
    r = tl.arange(0, BLOCK_R)
    is_req = r < num_reqs
    lo = tl.load(ext_starts_ptr + r, mask=r <= num_reqs, other=0)
    hi = tl.load(ext_starts_ptr + r + 1, mask=is_req, other=0)
    hi = tl.where(r == num_reqs, num_tokens, hi)
    n_tiles = tl.cdiv(hi - lo, BLOCK_T)
    tile_ends = tl.cumsum(n_tiles, 0)
    req = tl.sum((tile_ends <= pid_tile).to(tl.int32))
    mine = r == req
    tile_in_req = pid_tile - tl.sum(tl.where(mine, tile_ends - n_tiles, 0))
    tok_lo = tl.sum(tl.where(mine, lo, 0)) + tile_in_req * BLOCK_T
    tok_hi = tl.sum(tl.where(mine, hi, 0))
    real_req = req < num_reqs
    # The padding pseudo-request has no keys: seq_len 0 makes all its pages -inf.
    seq_len = tl.load(seq_lens_ptr + req, mask=real_req, other=0)

    # Row = (token, head), heads fastest, so one dot covers all heads of all tokens of the tile.
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = tok_lo + rows // BLOCK_H
    head = rows % BLOCK_H
    row_ok = (tok < tok_hi) & (head < num_heads)
    tok64 = tok.to(tl.int64)
    pos = tl.load(pos_ptr + tok64, mask=row_ok, other=-1).to(tl.int64)
    # Last visible key per row: the query's own position, never past the request's length.
    last_key = tl.where(row_ok, tl.minimum(pos, seq_len.to(tl.int64) - 1), -1)
    tile_last_key = tl.max(last_key, 0)
    n_visible = tl.where(tile_last_key >= 0, tile_last_key // PAGE_SIZE + 1, 0).to(tl.int32)

    first = pid_chunk * pages_per_prog
    end = tl.minimum(first + pages_per_prog, max_blocks)
    end = tl.where(tok_lo < tok_hi, end, first)  # a tile past the last request does nothing
    end_visible = tl.maximum(tl.minimum(end, n_visible), first)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if Q_TO_F16:  # bf16 queries scored in fp16: clamp so an outlier cannot turn into inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(DOT_DTYPE)

    out_rows = out_ptr + tok64 * stride_ot + head * stride_oh
    kp = tl.arange(0, BLOCK_P)
    kp_ok = kp < PAGE_SIZE
    req_pages = page_table_ptr + req.to(tl.int64) * stride_ptb
    for j in range(first, end_visible):
        phys = tl.load(req_pages + j * stride_ptp).to(tl.int64)
        key_pos = j * PAGE_SIZE + kp
        # Keys past the tile's last visible key are never loaded (no traffic for the future
        # part of the query's own page, and slots past seq_len may hold stale data).
        load_ok = kp_ok & (key_pos <= tile_last_key)
        slots = phys * PAGE_SIZE + kp
        keys_t = tl.load(
            k_ptr + slots[None, :] * stride_ks + d[:, None] * stride_kd,
            mask=d_ok[:, None] & load_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, keys_t, input_precision="ieee")
        visible = kp_ok[None, :] & (key_pos[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        tl.store(out_rows + j * stride_ob, tl.max(s, 1), mask=row_ok)
    neg_inf = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    for j in range(end_visible, end):
        tl.store(out_rows + j * stride_ob, neg_inf, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_blocks", "stride_st", "stride_sh"])
def _select_blocks_kernel(
    scores_ptr,
    pos_ptr,
    out_ptr,
    num_rows,
    num_heads,
    num_blocks,
    topk,
    local_blocks,
    init_blocks,
    page_size,
    stride_st,
    stride_sh,
    stride_sb,
    stride_ot,
    stride_oh,
    stride_ok,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RADIX: tl.constexpr,
):
    # ROWS (token, head) rows per program, each reduced along axis 1: short rows are packed so a
    # program has enough elements, long rows (thousands of blocks) take a program each.
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < num_rows
    t = (row // num_heads).to(tl.int64)
    h = row % num_heads
    q_block = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int64) // page_size

    n = tl.arange(0, BLOCK_N)
    live = row_ok[:, None] & (n < num_blocks)[None, :]
    s = tl.load(
        scores_ptr + t[:, None] * stride_st + h[:, None] * stride_sh + n[None, :] * stride_sb,
        mask=live,
        other=float("-inf"),
    )
    # Order-preserving float -> uint32 key: flip every bit of negatives, set the sign bit of
    # the rest. Then -inf (not selectable) -> 0, forced -> max, so plain unsigned compares rank.
    bits = s.to(tl.uint32, bitcast=True)
    key = tl.where((bits & 0x80000000) != 0, ~bits, bits | 0x80000000)
    key = tl.where(s == float("-inf"), tl.zeros_like(key), key)
    # Forced: the local blocks (the `local_blocks` blocks ending at the query's block, clipped
    # at block 0) and the init blocks that are not in the query's future.
    qb = q_block[:, None]
    forced = live & (n[None, :] <= qb)
    forced &= (n[None, :] > qb - local_blocks) | (n[None, :] < init_blocks)
    key = tl.where(forced, tl.full([ROWS, BLOCK_N], 0xFFFFFFFF, tl.uint32), key)

    n_valid = tl.sum((key > 0).to(tl.int32), 1)
    k_eff = tl.minimum(n_valid, topk)
    # Largest threshold with at least k_eff keys >= it, built digit by digit from the top: it is
    # the k_eff-th largest key. 32 / RADIX fixed passes over the register-resident rows, no sort;
    # a pass counts the keys at or above each of the 2^RADIX candidate digits at once (the
    # counts fall with the digit, so the digit is how many candidates keep k_eff keys, minus the
    # zero digit, which always does). Each pass is one latency-bound reduction, so fewer, wider
    # passes finish sooner.
    thr = tl.zeros([ROWS], tl.uint32)
    digits = tl.arange(0, 1 << RADIX).to(tl.uint32)
    for p in tl.static_range(32 // RADIX):
        cand = thr[:, None] | (digits[None, :] << (32 - RADIX * (p + 1)))
        count = tl.sum((key[:, None, :] >= cand[:, :, None]).to(tl.int32), 2)
        digit = tl.sum((count >= k_eff[:, None]).to(tl.uint32), 1) - 1
        thr = thr | (digit << (32 - RADIX * (p + 1)))
    above = key > thr[:, None]
    tied = (key == thr[:, None]).to(tl.int32)
    room = k_eff - tl.sum(above.to(tl.int32), 1)
    # Ties at the threshold: the lowest block ids take the remaining room.
    tie_rank = tl.cumsum(tied, 1) - tied
    chosen = above | ((tied != 0) & (tie_rank < room[:, None]))
    slot = tl.cumsum(chosen.to(tl.int32), 1) - 1

    out_rows = out_ptr + t * stride_ot + h * stride_oh
    ids = tl.broadcast_to(n[None, :], [ROWS, BLOCK_N])
    tl.store(out_rows[:, None] + slot * stride_ok, ids, mask=chosen)
    k = tl.arange(0, BLOCK_K)
    pad = row_ok[:, None] & (k[None, :] >= k_eff[:, None]) & (k[None, :] < topk)
    minus_one = tl.full([ROWS, BLOCK_K], -1, tl.int32)
    tl.store(out_rows[:, None] + k[None, :] * stride_ok, minus_one, mask=pad)


def _dot_dtype(q: torch.Tensor, keys: torch.Tensor) -> tl.dtype:
    """Operand type of the score dot: fp32 (exact, non-TF32) when either side is fp32, else a
    16-bit type. fp8 keys are scored in fp16: e4m3 -> fp16 is exact and one hardware conversion
    per pair, where -> bf16 goes through fp32 (H200, 128K context, batch 32: 140 vs 217 µs);
    bf16 queries are exact in fp16 over [2^-14, 65504], and index queries come out of an
    RMSNorm. Off the GPU (Triton's interpreter, whose dot multiplies bf16 as raw uint16 bits)
    fp32 gives the same exact products."""
    if q.dtype == torch.float32 or keys.dtype == torch.float32 or q.device.type != "cuda":
        return tl.float32
    if q.dtype == torch.float16 or keys.dtype == torch.float8_e4m3fn:
        return tl.float16
    return tl.bfloat16


def _tokens_per_tile(num_tokens: int, num_reqs: int, block_h: int) -> int:
    """Tokens per program from shapes only: the mean extend length, rounded up to a power of
    two, within [16, 128] dot rows. Decode gets one MMA-minimum tile; prefill shares each key
    load among up to 128 rows."""
    mean_extend = -(-num_tokens // max(num_reqs, 1))
    rows = min(max(triton.next_power_of_2(mean_extend) * block_h, _MIN_ROWS), _MAX_ROWS)
    return max(rows // block_h, 1)


def _rows_per_program(num_rows: int, block_n: int, device: torch.device) -> int:
    """(token, head) rows per top-k program. On the GPU: pack short rows up to ~2K elements
    while keeping ~2 programs per SM, since each program's 32 passes are latency-bound. In the
    interpreter a program costs per op, not per element: pack up to the cap whatever the count."""
    cap = max(_TOPK_ELEMENTS // block_n, 1)
    if device.type == "cuda":
        cap = min(cap, max(num_rows // _TOPK_MIN_PROGRAMS, 1))
    return min(triton.next_power_of_2(cap + 1) // 2, triton.next_power_of_2(num_rows))


def _select_warps(rows: int, block_n: int) -> int:
    """Warps of a top-k program. One row (decode): ~4 elements per thread, since each of its
    serial reductions costs a cross-warp step per warp (H200: 64 blocks 3.1 µs on one warp vs
    9.1 µs on four; 1024 blocks 7.8 µs on eight; 8192 blocks 24 µs on sixteen). Packed short
    rows (prefill): ~16-32 elements per thread, at least four warps."""
    if rows == 1:
        return min(triton.next_power_of_2(max(block_n // 128, 1)), 16)
    return min(max(rows * block_n // 512, 4), 16)


def _pages_per_program(num_tiles: int, max_blocks: int, rows: int) -> int:
    """Logical pages per score program: split the (tile, page) work into ~_TARGET_PROGRAMS
    programs, with a floor that keeps each program's prologue (`rows` query rows) amortized."""
    per = triton.next_power_of_2(max(-(-num_tiles * max_blocks // _TARGET_PROGRAMS), 1))
    least = _MIN_PAGES_PER_DECODE_PROGRAM if rows <= _MIN_ROWS else _MIN_PAGES_PER_PROGRAM
    return max(min(per, max_blocks), min(least, max_blocks))


def block_scores(
    q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    max_blocks: int,
    out: torch.Tensor | None = None,
    *,
    pages_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Page-max index scores [T, H_idx, max_blocks] fp32 of every new token over its request.

    q [T, H_idx, Di] index queries (after norm + RoPE); index_k_cache [num_pages * page_size, Di]
    (slot-major, one head); page_table [B, >= pages] int32 (logical -> physical page, -1 padded);
    seq_lens [B] int32; extend_starts [B + 1] int32 (request b owns rows [s[b], s[b+1]));
    positions [T] int64. Entry [t, h, j] = max over keys of logical page j at positions <=
    positions[t] (and < the request's seq_len) of q[t, h] . k, fp32; -inf if there is none.
    Rows after extend_starts[B] (graph padding) are all -inf. pages_per_program, num_warps
    and num_stages override the launch tuning derived from the shapes.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = page_table.shape[0]
    if index_k_cache.dim() != 2 or index_k_cache.shape[1] != head_dim:
        raise ValueError(f"index_k_cache {tuple(index_k_cache.shape)} is not [slots, {head_dim}]")
    if index_k_cache.dtype not in _KEY_TYPES:
        raise ValueError(f"unsupported index-K dtype {index_k_cache.dtype}")
    if seq_lens.shape != (num_reqs,) or extend_starts.shape != (num_reqs + 1,):
        raise ValueError("seq_lens must be [B] and extend_starts [B + 1] for page_table [B, P]")
    if positions.shape != (num_tokens,) or max_blocks < 1 or page_size < 1:
        raise ValueError("positions must be [T]; max_blocks and page_size must be positive")
    if out is None:
        out = torch.empty(num_tokens, num_heads, max_blocks, dtype=torch.float32, device=q.device)
    elif out.shape != (num_tokens, num_heads, max_blocks) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [{num_tokens}, {num_heads}, {max_blocks}]")
    if num_tokens == 0:
        return out

    block_h = triton.next_power_of_2(num_heads)
    block_t = _tokens_per_tile(num_tokens, num_reqs, block_h)
    # Upper bound on the tiles of all requests plus the padding pseudo-request: each non-empty
    # one needs 1 + (len - 1) // block_t tiles.
    busy = min(num_reqs + 1, num_tokens)
    num_tiles = busy + (num_tokens - busy) // block_t
    rows = block_t * block_h
    pages_per_prog = pages_per_program or _pages_per_program(num_tiles, max_blocks, rows)
    grid = (num_tiles, triton.cdiv(max_blocks, pages_per_prog))
    dot_dtype = _dot_dtype(q, index_k_cache)
    launch(
        _block_scores_kernel,
        grid,
        q,
        index_k_cache,
        page_table,
        seq_lens,
        extend_starts,
        positions,
        out,
        num_tokens,
        num_reqs,
        num_heads,
        head_dim,
        max_blocks,
        pages_per_prog,
        *q.stride(),
        *index_k_cache.stride(),
        *page_table.stride(),
        *out.stride(),
        PAGE_SIZE=page_size,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_P=max(triton.next_power_of_2(page_size), 16),
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_R=max(triton.next_power_of_2(num_reqs + 1), 2),
        DOT_DTYPE=dot_dtype,
        Q_TO_F16=dot_dtype == tl.float16 and q.dtype == torch.bfloat16,
        num_warps=num_warps or (4 if rows <= 32 else 8),
        # Deep pipelining pays for programs that stream many pages (batch 32 at 128K: 247 vs
        # 258 µs) and costs the short programs of batch 1 (two pages each then: 11.1 vs 8.0 µs).
        num_stages=num_stages or (5 if pages_per_prog >= 8 else 3),
    )
    return out


def select_blocks(
    scores: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
    out: torch.Tensor | None = None,
    radix_bits: int = 2,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Block ids [T, H_idx, topk] int32 from scores [T, H_idx, num_blocks] (fp32, -inf = not
    selectable). The local blocks (the `local_blocks` blocks ending at positions // page_size)
    and the init blocks 0..init_blocks-1 that are not in the query's future are always taken;
    the rest of the topk slots go to the highest scores. Valid ids come first in ascending
    order, then -1; no duplicates; ties at the k-th score go to the lower block id.
    radix_bits (bits settled per search step, dividing 32) and num_warps are tuning knobs.
    """
    num_tokens, num_heads, num_blocks = scores.shape
    if radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"radix_bits must be 1, 2, 4 or 8, got {radix_bits}")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32, got {scores.dtype}")
    if positions.shape != (num_tokens,) or topk < 1 or page_size < 1:
        raise ValueError("positions must be [T]; topk and page_size must be positive")
    if out is None:
        out = torch.empty(num_tokens, num_heads, topk, dtype=torch.int32, device=scores.device)
    elif out.shape != (num_tokens, num_heads, topk) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 [{num_tokens}, {num_heads}, {topk}]")
    if num_tokens * num_heads == 0:
        return out
    num_rows = num_tokens * num_heads
    block_n = max(triton.next_power_of_2(num_blocks), 16)
    rows = _rows_per_program(num_rows, block_n, scores.device)
    launch(
        _select_blocks_kernel,
        (triton.cdiv(num_rows, rows),),
        scores,
        positions,
        out,
        num_rows,
        num_heads,
        num_blocks,
        topk,
        local_blocks,
        init_blocks,
        page_size,
        *scores.stride(),
        *out.stride(),
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=max(triton.next_power_of_2(topk), 2),
        RADIX=radix_bits,
        num_warps=num_warps or _select_warps(rows, block_n),
    )
    return out


def index_topk(
    q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    max_blocks: int,
    *,
    scores: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Both stages: block ids [T, H_idx, topk] int32 (see `block_scores`, `select_blocks`).

    max_blocks bounds the logical pages scored per request (e.g. the longest request's pages,
    or the capture bucket's); `scores` [T, H_idx, max_blocks] fp32 and `out` are optional
    preallocated buffers (CUDA graphs).
    """
    scores = block_scores(
        q,
        index_k_cache,
        page_table,
        seq_lens,
        extend_starts,
        positions,
        page_size,
        max_blocks,
        out=scores,
    )
    return select_blocks(scores, positions, page_size, topk, local_blocks, init_blocks, out=out)
