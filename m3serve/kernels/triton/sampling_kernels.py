"""The Triton kernels behind `sampling.py` (its docstring gives the semantics they implement).

`sample_kernel`: one program samples one row, reading the vocab in tiles (`sampling_chunks.py`
spreads passes 1-3 over several programs a row):

1. Max pass: the largest logit m and its first index. Greedy rows stop here.
2. Histogram pass: each token's weight relative to the max, w = exp((x - m) / T) in (0, 1],
   goes into one of 32 one-octave bins of log2(w); the pass also sums the mass. The bin counts
   give lower bounds on the top-k cut (the k-th token's bin) and on the top-p cut (the first
   bin edge below which an upper bound on the tail mass fits in 1 - top_p), with no search.
3. Gather pass: every token at or above the bound (id and logit) goes into a per-row scratch
   list: all the tokens the filters can keep, typically tens to a few thousand.
4. Exact cuts by a 16-way search over the candidates on the bit pattern of w (ordered like w,
   as w >= 0): the largest cut with count(w >= cut) >= k for top-k, then the largest with
   mass(w >= cut) >= top_p * (mass that top-k and min-p keep) for top-p. A search stops once
   at most one candidate lies between its brackets, so it ends on the exact set, ties included.
5. An exponential race over the kept candidates: argmax of log w_j - log E_j with E_j ~ Exp(1)
   is a draw from the renormalized kept distribution (no cumsum, no second pass).

A row whose candidates overflow the scratch list runs steps 4-5 over the whole row instead,
with a binary search (one pass per step: slow, but exact and with the same token). A row with
no filter skips to a race over the whole row (one pass).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The torch sampler clamps temperatures here: below it logits / T can overflow.
_MIN_TEMPERATURE = tl.constexpr(1e-5)
_LOG2E = tl.constexpr(1.4426950408889634)
# One-octave bins of -log2(w); the last one collects every w <= 2**-31. 32 is the fewest bins
# tl.histogram handles, and its cost per element grows with the number of bins.
_BINS = tl.constexpr(32)
# Relative slack on bin edges: the bins come from log2(w) and the cuts from exp2 of it, which
# may differ by a few ulps.
_EDGE_SLACK = tl.constexpr(1.0 / 65536)
# Bit pattern of 1.0f: no weight exceeds it (the max token's weight is exactly 1).
_ONE_BITS = tl.constexpr(0x3F800000)
# (bits + 0.5) * 2**-32 maps 32 random bits into (0, 1].
_TWO_POW_M32 = tl.constexpr(2.3283064365386963e-10)
# Pivots per step of the candidate search (a power of two).
_PIVOTS = tl.constexpr(16)


@triton.jit
def _row_max(row_ptr, n, first, step, BLOCK: tl.constexpr):
    """Largest value of the row's tiles at first, first + step, ... below n, and the first index
    holding it (NaNs are skipped). A whole row: first 0, step BLOCK."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    # Per-lane running maxima, reduced once at the end instead of once per tile. A strict >
    # keeps each lane's earliest index, so the smallest index among the lanes holding the max
    # is the row's first.
    for start in range(first, n, step):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < n, other=float("-inf"))
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, n), axis=0)
    return top, first


@triton.jit
def _histogram_pass(row_ptr, n, m, s2, min_p_bits, first, step, BLOCK: tl.constexpr):
    """Counts of -log2(w) in one-octave bins, and the mass of the tokens that min-p keeps, over
    the tiles at first, first + step, ... below n."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], tl.float32)
    hist = tl.zeros([_BINS], tl.int32)
    for start in range(first, n, step):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < n, other=float("-inf"))
        t = (x - m) * s2  # log2(w) <= 0
        w = tl.exp2(t)
        mass += tl.where(w.to(tl.int32, bitcast=True) >= min_p_bits, w, 0.0)
        # The comparison form sends NaN and the masked tail (t = -inf) to the last bin, and
        # keeps the float -> int conversion in range (on the GPU, tl.histogram reads only the
        # low bits of a bin index, so a larger one would land in a wrong bin).
        r = -t
        b = tl.where(r < _BINS - 1, r, _BINS - 1).to(tl.int32)
        hist += tl.histogram(b, _BINS)
    return hist, tl.sum(mass, axis=0)


@triton.jit
def _bounds_from_bins(hist, kept_mass, k, top_p, has_k, has_p):
    """Lower bounds on the top-k and top-p cuts, as weights (0 where there is none).

    Bin b < 31 holds the weights in (2**-(b+1), 2**-b].
    """
    bins = tl.arange(0, _BINS)
    # top-k: the first bin where the running count reaches k holds the k-th largest weight,
    # so the cut is no lower than that bin's bottom edge.
    count_through = tl.cumsum(hist, axis=0)
    b_k = tl.min(tl.where(count_through >= k, bins, _BINS), axis=0)
    k_floor = tl.exp2(-(b_k + 1).to(tl.float32)) * (1.0 - _EDGE_SLACK)
    k_floor = tl.where(has_k & (b_k < _BINS - 1), k_floor, 0.0)
    # top-p: taking every weight at its bin's top bounds the mass below each bin edge. Once
    # that tail fits in (1 - top_p) of the kept mass, the tokens above the edge reach top_p by
    # themselves, so the cut is no lower than the edge. The 1e-5 covers the float sums.
    top_w = hist.to(tl.float32) * tl.exp2(-bins.to(tl.float32)) * (1.0 + _EDGE_SLACK)
    tail_below = tl.sum(top_w, axis=0) - tl.cumsum(top_w, axis=0)
    budget = (1.0 - top_p - 1e-5) * kept_mass
    b_p = tl.min(tl.where(tail_below <= budget, bins, _BINS), axis=0)
    p_floor = tl.exp2(-(b_p + 1).to(tl.float32)) * (1.0 - _EDGE_SLACK)
    p_floor = tl.where(has_p & (b_p < _BINS - 1), p_floor, 0.0)
    return k_floor, p_floor


@triton.jit
def _gather_pass(
    row_ptr, n, m, s2, floor_w, ids_ptr, xs_ptr, cap, first, step, BLOCK: tl.constexpr
):
    """Copy (id, logit) of every token with w >= floor_w in the tiles at first, first + step,
    ... below n into the scratch list. Returns their number, or some number above cap once they
    cannot all fit (the pass then stops early)."""
    offs = tl.arange(0, BLOCK)
    floor_bits = floor_w.to(tl.int32, bitcast=True)
    count = tl.program_id(0) * 0
    start = count + first
    while (start < n) & (count <= cap):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < n, other=float("-inf"))
        # Most tiles hold no candidate: one reduction rules them out before any exp2 or scan.
        # Half the floor leaves room for exp2 not being exactly monotone.
        if tl.exp2((tl.max(x, axis=0) - m) * s2) >= 0.5 * floor_w:
            w = tl.exp2((x - m) * s2)
            hit = (idx < n) & (w.to(tl.int32, bitcast=True) >= floor_bits)
            slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            fits = hit & (slot < cap)
            tl.store(ids_ptr + slot, idx, mask=fits)
            tl.store(xs_ptr + slot, x, mask=fits)
            count += tl.sum(hit.to(tl.int32), axis=0)
        start += step
    return count


@triton.jit
def _count_mass(src_ptr, n, m, s2, cut, BLOCK: tl.constexpr):
    """Count and mass of the tokens in src[0:n] whose weight bits are >= cut."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        # .cg reads through L2: the scratch list was written by other threads of this program.
        x = tl.load(src_ptr + idx, mask=idx < n, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2((x - m) * s2)
        hit = (idx < n) & (w.to(tl.int32, bitcast=True) >= cut)
        count += hit.to(tl.int32)
        mass += tl.where(hit, w, 0.0)
    return tl.sum(count, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _search(
    src_ptr,
    n,
    m,
    s2,
    lo,
    count_lo,
    need_count,
    need_mass,
    BY_MASS: tl.constexpr,
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The largest cut (weight bits) with count(w >= cut) >= need_count, or with
    mass(w >= cut) >= need_mass if BY_MASS, over src[0:n]; lo must satisfy it and count_lo
    is count(w >= lo). The tokens with w >= the result are exactly the ones the cut keeps.

    Each step tries PIVOTS cuts spread over [lo, hi) in one pass; hi never satisfies the
    condition (no weight exceeds 1). Once at most one token lies in [lo, hi), every cut in
    (lo, hi] keeps what hi keeps, so lo keeps the right set.
    """
    offs = tl.arange(0, BLOCK)
    step = tl.arange(0, PIVOTS) + 1
    hi = lo * 0 + _ONE_BITS + 1
    count_hi = count_lo * 0
    while (hi - lo > 1) & (count_lo - count_hi > 1):
        # In [lo, hi), increasing; the last lies strictly above lo, so each step narrows.
        pivots = lo + ((hi - lo).to(tl.int64) * step // (PIVOTS + 1)).to(tl.int32)
        # Per-lane sums, reduced once a step: a reduction per tile waited on its cross-warp
        # exchange every tile (over 17K candidates of a flat 200K-token row, ~0.5 ms a row).
        lane_counts = tl.zeros([PIVOTS, BLOCK], tl.int32)
        lane_masses = tl.zeros([PIVOTS, BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            idx = start + offs
            x = tl.load(src_ptr + idx, mask=idx < n, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2((x - m) * s2)
            key = tl.where(idx < n, w.to(tl.int32, bitcast=True), -1)
            hit = key[None, :] >= pivots[:, None]
            lane_counts += hit.to(tl.int32)
            lane_masses += tl.where(hit, w[None, :], 0.0)
        counts = tl.sum(lane_counts, axis=1)
        masses = tl.sum(lane_masses, axis=1)
        ok = masses >= need_mass if BY_MASS else counts >= need_count
        # Counts fall as the cut rises: the highest passing pivot has the smallest passing
        # count, the lowest failing one the largest failing count.
        lo_next = tl.max(tl.where(ok, pivots, lo), axis=0)
        count_lo = tl.min(tl.where(ok, counts, count_lo), axis=0)
        hi = tl.min(tl.where(ok, hi, pivots), axis=0)
        count_hi = tl.max(tl.where(ok, count_hi, counts), axis=0)
        lo = lo_next
    return lo


@triton.jit
def _exponential(bits):
    """Exp(1) draws from uniform 32-bit integers, accurate near 0: the small draws are the
    ones that win a race, so -log(1 - v) takes its series there instead of log(~1)."""
    v = (bits.to(tl.float32) + 0.5) * _TWO_POW_M32
    # The largest bits round v up to 1.0; keep -log(1 - v) finite (it caps draws at ~16.6).
    v = tl.minimum(v, 0.99999994)
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
    return tl.where(v < 0.0078125, series, -tl.log(1.0 - v))


@triton.jit
def _noise_bits(seed, off_lo, off_hi, token):
    """The race's random bits for arbitrary token ids: output token % 4 of the Philox block at
    counter token // 4 (the same bits `_race_row` takes four at a time)."""
    group = (token >> 2).to(tl.uint32)
    zero = group * 0
    r0, r1, r2, r3 = tl.philox(seed, group, zero + off_lo, zero + off_hi, zero)
    lane = token & 3
    return tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))


@triton.jit
def _race_candidates(ids_ptr, xs_ptr, n, m, s2, cut, seed, off_lo, off_hi, BLOCK: tl.constexpr):
    """Race among the scratch candidates whose weight bits are >= cut. Returns the winning
    token and the smallest kept logit."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        valid = idx < n
        token = tl.load(ids_ptr + idx, mask=valid, other=0, cache_modifier=".cg")
        x = tl.load(xs_ptr + idx, mask=valid, other=float("-inf"), cache_modifier=".cg")
        t = (x - m) * s2
        kept = valid & (tl.exp2(t).to(tl.int32, bitcast=True) >= cut)
        e = _exponential(_noise_bits(seed, off_lo, off_hi, token))
        # log2(w / E): the argmax of w / E without underflow for tiny weights.
        score = tl.where(kept, t - tl.log2(e), float("-inf"))
        # Candidates are not in id order: exact score ties go to the smaller id.
        better = (score > best) | ((score == best) & (token < best_id))
        best = tl.where(better, score, best)
        best_id = tl.where(better, token, best_id)
        low = tl.where(kept, tl.minimum(low, x), low)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_id, 0x7FFFFFFF), axis=0)
    return winner, tl.min(low, axis=0)


@triton.jit
def _race_row(
    row_ptr,
    n,
    m,
    s2,
    cut,
    seed,
    off_lo,
    off_hi,
    first,
    step,
    FILTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Race over the row's tiles at first, first + step, ... below n (the tokens with weight
    bits >= cut if FILTERED). Returns the winning token, its score and the smallest kept logit.

    Tiles are [BLOCK / 4, 4], so that one Philox call feeds four consecutive tokens.
    """
    QUADS: tl.constexpr = BLOCK // 4
    quad = tl.arange(0, QUADS)
    lane = tl.arange(0, 4)[None, :]
    best = tl.full([QUADS, 4], float("-inf"), tl.float32)
    best_id = tl.zeros([QUADS, 4], tl.int32)
    low = tl.full([QUADS, 4], float("inf"), tl.float32)
    for start in range(first, n, step):
        idx = start + quad[:, None] * 4 + lane
        valid = idx < n
        x = tl.load(row_ptr + idx, mask=valid, other=float("-inf"))
        t = (x - m) * s2
        kept = valid
        if FILTERED:
            kept = valid & (tl.exp2(t).to(tl.int32, bitcast=True) >= cut)
        group = ((start >> 2) + quad).to(tl.uint32)
        zero = group * 0
        r0, r1, r2, r3 = tl.philox(seed, group, zero + off_lo, zero + off_hi, zero)
        bits = tl.where(
            lane == 0,
            r0[:, None],
            tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
        )
        score = tl.where(kept, t - tl.log2(_exponential(bits)), float("-inf"))
        # Ids grow with the tile, so a strict > keeps each lane's first maximum.
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, idx, best_id)
        low = tl.where(kept, tl.minimum(low, x), low)
    top = tl.max(best, axis=None)
    winner = tl.min(tl.where(best == top, best_id, 0x7FFFFFFF), axis=None)
    return winner, top, tl.min(low, axis=None)


@triton.jit
def _knobs(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, V):
    """A row's filters: (greedy, k, top_p, min_p, has_k, has_p, has_m, 1 / T in log2 units)."""
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    # min_p > 1 would keep nothing; the most probable token always stays.
    min_p = tl.minimum(tl.maximum(tl.load(min_p_ptr + row), 0.0), 1.0)
    greedy = (temperature <= 0.0) | (k == 1)
    s2 = _LOG2E / tl.maximum(temperature, _MIN_TEMPERATURE)
    return greedy, k, top_p, min_p, (k > 0) & (k < V), top_p < 1.0, min_p > 0.0, s2


@triton.jit
def _stream(seed_ptr, offset_ptr, row):
    """The row's Philox key and counter words."""
    seed = tl.load(seed_ptr + row)
    offset = tl.load(offset_ptr + row)
    off_lo = (offset & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return seed, off_lo, off_hi


@triton.jit
def _floor(hist, kept_mass, k, top_p, min_p, has_k, has_p):
    """The gather's floor weight: every token the filters can keep has w >= it."""
    k_floor, p_floor = _bounds_from_bins(hist, kept_mass, k, top_p, has_k, has_p)
    # With top-k on, top-p's mass is that of the top-k set, which the search must see whole,
    # so the gather stops at the top-k bound. Without top-k, top-p's mass is kept_mass (from
    # the histogram pass) and its own bound applies.
    return tl.maximum(tl.where(has_k, k_floor, p_floor), min_p)


@triton.jit
def _cut_and_race(
    row_ptr,
    V,
    m,
    s2,
    floor_w,
    kept_mass,
    k,
    top_p,
    min_p,
    has_k,
    has_p,
    row_ids,
    row_xs,
    n_cand,
    fits,
    seed,
    off_lo,
    off_hi,
    BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
):
    """Steps 4-5 of a filtered row: the exact cuts over the n_cand gathered candidates (or,
    unless they all `fits`, over the whole row), then the race. Returns (token, smallest kept
    logit)."""
    min_p_bits = min_p.to(tl.int32, bitcast=True)
    # Every search starts at or above floor_w, where the candidates are all the tokens.
    cut = floor_w.to(tl.int32, bitcast=True)
    if fits:
        if has_k:
            cut = _search(row_xs, n_cand, m, s2, cut, n_cand, k, 0.0, False, _PIVOTS, CAND_BLOCK)
            cut = tl.maximum(cut, min_p_bits)
        if has_p:
            count_lo, mass_lo = _count_mass(row_xs, n_cand, m, s2, cut, CAND_BLOCK)
            if has_k:
                kept_mass = mass_lo
            need = top_p * kept_mass
            cut = _search(row_xs, n_cand, m, s2, cut, count_lo, 0, need, True, _PIVOTS, CAND_BLOCK)
        token, low = _race_candidates(
            row_ids, row_xs, n_cand, m, s2, cut, seed, off_lo, off_hi, CAND_BLOCK
        )
    else:
        # Same searches over the whole row: a binary step per pass, as each pass costs a full
        # read and every extra pivot a full row of compares.
        if has_k:
            count_lo, _mass = _count_mass(row_ptr, V, m, s2, cut, BLOCK)
            cut = _search(row_ptr, V, m, s2, cut, count_lo, k, 0.0, False, 1, BLOCK)
            cut = tl.maximum(cut, min_p_bits)
        if has_p:
            count_lo, mass_lo = _count_mass(row_ptr, V, m, s2, cut, BLOCK)
            if has_k:
                kept_mass = mass_lo
            cut = _search(row_ptr, V, m, s2, cut, count_lo, 0, top_p * kept_mass, True, 1, BLOCK)
        token, _top, low = _race_row(
            row_ptr, V, m, s2, cut, seed, off_lo, off_hi, 0, BLOCK, True, BLOCK
        )
    return token, low


@triton.jit
def sample_kernel(
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
    ids_ptr,
    xs_ptr,
    V,
    cap,
    BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    WRITE_FLOOR: tl.constexpr,
):
    """One program a row: the passes over the vocab one after the other."""
    pid = tl.program_id(0)
    row_ptr = logits_ptr + pid.to(tl.int64) * stride_row
    greedy, k, top_p, min_p, has_k, has_p, has_m, s2 = _knobs(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, pid, V
    )
    if greedy:
        top, token = _row_max(row_ptr, V, 0, BLOCK, BLOCK)
        low = top
    else:
        seed, off_lo, off_hi = _stream(seed_ptr, offset_ptr, pid)
        if has_k | has_p | has_m:
            m, _argmax = _row_max(row_ptr, V, 0, BLOCK, BLOCK)
            hist = tl.zeros([_BINS], tl.int32)
            kept_mass = min_p * 0.0
            if has_k | has_p:
                min_p_bits = min_p.to(tl.int32, bitcast=True)
                hist, kept_mass = _histogram_pass(row_ptr, V, m, s2, min_p_bits, 0, BLOCK, BLOCK)
            floor_w = _floor(hist, kept_mass, k, top_p, min_p, has_k, has_p)
            row_ids = ids_ptr + pid.to(tl.int64) * cap
            row_xs = xs_ptr + pid.to(tl.int64) * cap
            n_cand = _gather_pass(row_ptr, V, m, s2, floor_w, row_ids, row_xs, cap, 0, BLOCK, BLOCK)
            # Other threads of this program read the scratch list back.
            tl.debug_barrier()
            token, low = _cut_and_race(
                row_ptr, V, m, s2, floor_w, kept_mass, k, top_p, min_p, has_k, has_p,
                row_ids, row_xs, n_cand, n_cand <= cap, seed, off_lo, off_hi, BLOCK, CAND_BLOCK,
            )  # fmt: skip
        else:
            # No filter: the race alone, shifted by 0 instead of the max (argmax does not care).
            token, _top, low = _race_row(
                row_ptr, V, 0.0, s2, 0, seed, off_lo, off_hi, 0, BLOCK, False, BLOCK
            )
    tl.store(out_ptr + pid, token.to(tl.int64))
    if WRITE_FLOOR:
        tl.store(floor_out_ptr + pid, low)


@triton.jit
def greedy_kernel(logits_ptr, stride_row, out_ptr, V, BLOCK: tl.constexpr):
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * stride_row
    _, token = _row_max(row_ptr, V, 0, BLOCK, BLOCK)
    tl.store(out_ptr + tl.program_id(0), token.to(tl.int64))
