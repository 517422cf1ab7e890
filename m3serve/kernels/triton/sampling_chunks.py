"""The sampler's passes spread over several programs a row (`sampling.sample` with chunks > 1).

One program a row streams the vocab at what one SM can pull: over M3.1's 200064 tokens a
top-k row took 273 µs and a top-p 0.95 row 1.0 ms at batch 1 on an H100, most of the GPU idle
(perf/results/h100_2026-12-07e_sampler_chunks/). Here chunk c of a row owns the vocab tiles c,
c + C, c + 2C, ... (interleaved, so the candidates of a row spread evenly over the chunks), and
each pass of `sampling_kernels` runs as its own grid of [rows, C] programs:

1. `chunk_max_kernel`: each chunk's max logit and its first index.
2. `chunk_hist_kernel`: the row max from the chunks', then each chunk's octave histogram and
   min-p mass (rows with top-k or top-p).
3. `chunk_gather_kernel`: the floor from the summed histograms (the same in every chunk: integer
   counts, and the masses summed in chunk order), then each chunk's candidates into its own
   region of the scratch; rows without a filter race over their chunk instead.
4. `chunk_finish_kernel`, one program a row: greedy rows take the first index of the max;
   unfiltered rows the chunks' best race score (ties to the smaller id); filtered rows copy the
   regions into one list and run steps 4-5 of `sample_kernel` on it (`_cut_and_race`), or, if
   a region overflowed, over the whole row.

The draws are those of `sample_kernel`: the same floors, cuts and race noise per token id. Where
a float sum decides (a top-p cut's mass), the order of its terms differs, so a token lying
exactly on a top-p boundary may fall either way, as with a change of tile size.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3serve.kernels.triton.sampling_kernels import (
    _BINS,
    _cut_and_race,
    _floor,
    _gather_pass,
    _histogram_pass,
    _knobs,
    _race_row,
    _row_max,
    _stream,
)

# Not specialized on: one compiled variant a kernel whatever the batch (the chunk count and the
# regions' size follow it), so the warm-up's draws compile everything (`sampling.warm_up`).
_PER_CHUNK = ["chunks"]
_PER_REGION = ["chunks", "cap"]


@triton.jit
def _row_peak(pmax_ptr, row, chunks, CHUNKS_PAD: tl.constexpr):
    """The row's max logit from its chunks' maxima."""
    lane = tl.arange(0, CHUNKS_PAD)
    maxima = tl.load(pmax_ptr + row * chunks + lane, mask=lane < chunks, other=float("-inf"))
    return tl.max(maxima, axis=0)


@triton.jit
def _row_floor(
    pmax_ptr,
    phist_ptr,
    pmass_ptr,
    row,
    k,
    top_p,
    min_p,
    has_k,
    has_p,
    chunks,
    CHUNKS_PAD: tl.constexpr,
):
    """(row max, kept mass, gather floor) from the chunks' maxima, histograms and masses."""
    m = _row_peak(pmax_ptr, row, chunks, CHUNKS_PAD)
    lane = tl.arange(0, CHUNKS_PAD)
    ok = lane < chunks
    bins = tl.arange(0, _BINS)
    parts = (row * chunks + lane).to(tl.int64)
    hist_ptrs = phist_ptr + parts[:, None] * _BINS + bins[None, :]
    hist = tl.sum(tl.load(hist_ptrs, mask=ok[:, None], other=0), axis=0)
    kept_mass = tl.sum(tl.load(pmass_ptr + parts, mask=ok, other=0.0), axis=0)
    # Rows with min-p alone have empty histograms: their floor is min-p's.
    return m, kept_mass, _floor(hist, kept_mass, k, top_p, min_p, has_k, has_p)


@triton.jit(do_not_specialize=_PER_CHUNK)
def chunk_max_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    pmax_ptr,
    parg_ptr,
    V,
    chunks,
    CHUNKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy, _k, _p, _m, has_k, has_p, has_m, _s2 = _knobs(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, V
    )
    if greedy | has_k | has_p | has_m:  # a row without a filter races unshifted
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        top, first = _row_max(row_ptr, V, chunk * BLOCK, chunks * BLOCK, BLOCK)
        tl.store(pmax_ptr + row * chunks + chunk, top)
        tl.store(parg_ptr + row * chunks + chunk, first)


@triton.jit(do_not_specialize=_PER_CHUNK)
def chunk_hist_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    pmax_ptr,
    phist_ptr,
    pmass_ptr,
    V,
    chunks,
    CHUNKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy, _k, _p, min_p, has_k, has_p, _has_m, s2 = _knobs(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, V
    )
    here = row * chunks + chunk
    hist = tl.zeros([_BINS], tl.int32)
    mass = min_p * 0.0
    if (not greedy) & (has_k | has_p):
        m = _row_peak(pmax_ptr, row, chunks, CHUNKS_PAD)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        min_p_bits = min_p.to(tl.int32, bitcast=True)
        first = chunk * BLOCK
        hist, mass = _histogram_pass(row_ptr, V, m, s2, min_p_bits, first, chunks * BLOCK, BLOCK)
    # Written for every row, so the next kernels' sums never read stale scratch.
    tl.store(phist_ptr + here.to(tl.int64) * _BINS + tl.arange(0, _BINS), hist)
    tl.store(pmass_ptr + here, mass)


@triton.jit(do_not_specialize=_PER_REGION)
def chunk_gather_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    offset_ptr,
    pmax_ptr,
    phist_ptr,
    pmass_ptr,
    pcount_ptr,
    pscore_ptr,
    ptoken_ptr,
    plow_ptr,
    ids_ptr,
    xs_ptr,
    V,
    cap,
    chunks,
    CHUNKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Filtered rows: the chunk's candidates into region (row, chunk) of `cap` slots, and their
    count. Rows without a filter: the chunk's race winner, its score and the smallest logit."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy, k, top_p, min_p, has_k, has_p, has_m, s2 = _knobs(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, V
    )
    if not greedy:
        here = row * chunks + chunk
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        first = chunk * BLOCK
        if has_k | has_p | has_m:
            m, _mass, floor_w = _row_floor(
                pmax_ptr, phist_ptr, pmass_ptr, row, k, top_p, min_p, has_k, has_p, chunks,
                CHUNKS_PAD,
            )  # fmt: skip
            region = here.to(tl.int64) * cap
            n = _gather_pass(
                row_ptr, V, m, s2, floor_w, ids_ptr + region, xs_ptr + region, cap, first,
                chunks * BLOCK, BLOCK,
            )  # fmt: skip
            tl.store(pcount_ptr + here, n)
        else:
            seed, off_lo, off_hi = _stream(seed_ptr, offset_ptr, row)
            token, score, low = _race_row(
                row_ptr, V, 0.0, s2, 0, seed, off_lo, off_hi, first, chunks * BLOCK, False, BLOCK
            )
            tl.store(ptoken_ptr + here, token)
            tl.store(pscore_ptr + here, score)
            tl.store(plow_ptr + here, low)


@triton.jit
def _concatenate(
    ids_ptr,
    xs_ptr,
    pcount_ptr,
    list_ids,
    list_xs,
    row,
    cap,
    chunks,
    BLOCK: tl.constexpr,
):
    """The row's chunk regions, in chunk order, into one list."""
    offs = tl.arange(0, BLOCK)
    end = row * 0
    for chunk in range(chunks):
        here = row * chunks + chunk
        n = tl.load(pcount_ptr + here)
        region = here.to(tl.int64) * cap
        for start in range(0, n, BLOCK):
            idx = start + offs
            ok = idx < n
            token = tl.load(ids_ptr + region + idx, mask=ok, cache_modifier=".cg")
            x = tl.load(xs_ptr + region + idx, mask=ok, cache_modifier=".cg")
            tl.store(list_ids + end + idx, token, mask=ok)
            tl.store(list_xs + end + idx, x, mask=ok)
        end += n


@triton.jit(do_not_specialize=_PER_REGION)
def chunk_finish_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    offset_ptr,
    out_ptr,
    floor_out_ptr,
    pmax_ptr,
    parg_ptr,
    phist_ptr,
    pmass_ptr,
    pcount_ptr,
    pscore_ptr,
    ptoken_ptr,
    plow_ptr,
    ids_ptr,
    xs_ptr,
    list_ids_ptr,
    list_xs_ptr,
    V,
    cap,
    chunks,
    CHUNKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    WRITE_FLOOR: tl.constexpr,
):
    row = tl.program_id(0)
    greedy, k, top_p, min_p, has_k, has_p, has_m, s2 = _knobs(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, V
    )
    lane = tl.arange(0, CHUNKS_PAD)
    ok = lane < chunks
    parts = row * chunks + lane
    if greedy:
        maxima = tl.load(pmax_ptr + parts, mask=ok, other=float("-inf"))
        low = tl.max(maxima, axis=0)
        firsts = tl.load(parg_ptr + parts, mask=ok, other=0x7FFFFFFF)
        # Each chunk's index is its first at its max: the smallest of those at the row's max.
        token = tl.min(tl.where(ok & (maxima == low), firsts, 0x7FFFFFFF), axis=0)
    elif has_k | has_p | has_m:
        m, kept_mass, floor_w = _row_floor(
            pmax_ptr, phist_ptr, pmass_ptr, row, k, top_p, min_p, has_k, has_p, chunks, CHUNKS_PAD
        )
        counts = tl.load(pcount_ptr + parts, mask=ok, other=0)
        fits = tl.max(counts, axis=0) <= cap
        list_ids = list_ids_ptr + row.to(tl.int64) * chunks * cap
        list_xs = list_xs_ptr + row.to(tl.int64) * chunks * cap
        n_cand = tl.sum(tl.where(counts <= cap, counts, 0), axis=0)
        if fits:
            _concatenate(ids_ptr, xs_ptr, pcount_ptr, list_ids, list_xs, row, cap, chunks,
                         CAND_BLOCK)  # fmt: skip
            # Other threads of this program read the list back.
            tl.debug_barrier()
        seed, off_lo, off_hi = _stream(seed_ptr, offset_ptr, row)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        token, low = _cut_and_race(
            row_ptr, V, m, s2, floor_w, kept_mass, k, top_p, min_p, has_k, has_p, list_ids,
            list_xs, n_cand, fits, seed, off_lo, off_hi, BLOCK, CAND_BLOCK,
        )  # fmt: skip
    else:
        scores = tl.load(pscore_ptr + parts, mask=ok, other=float("-inf"))
        best = tl.max(scores, axis=0)
        winners = tl.load(ptoken_ptr + parts, mask=ok, other=0x7FFFFFFF)
        # Exact score ties go to the smaller id, as in one program's race.
        token = tl.min(tl.where(ok & (scores == best), winners, 0x7FFFFFFF), axis=0)
        low = tl.min(tl.load(plow_ptr + parts, mask=ok, other=float("inf")), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
    if WRITE_FLOOR:
        tl.store(floor_out_ptr + row, low)
