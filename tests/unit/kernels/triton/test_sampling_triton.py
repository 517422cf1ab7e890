"""Triton sampling (m3serve.kernels.triton.sampling) against the torch sampler's semantics.

On CPU this runs in Triton's interpreter, where every program costs tens of milliseconds, so
the batches stay small: vocab 1000 in 256-wide tiles (several tiles per row), a few dozen
rows per test. The kept set is read back through `kept_floor` and compared with
`filter_probs_batch` on rows whose knobs sit halfway between two achievable cuts, so float
rounding cannot move the boundary; sampled tokens are checked against the reference set
directly. Frequencies use fixed seeds, so every run draws the same tokens and the chi-square
bounds cannot flake.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch
from helpers.devices import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.kernels.sampling import filter_probs_batch
from m3serve.kernels.triton.sampling import greedy, sample

VOCAB = 1000
BLOCK = 256


@dataclass(frozen=True)
class Req:
    """One row: its logits come from `logit_seed` (scaled by `scale`) unless given."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    offset: int = 0
    logit_seed: int = 0
    scale: float = 2.0


def row_logits(req: Req, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(req.logit_seed)
    return torch.randn(vocab, generator=gen) * req.scale


def run(
    reqs: list[Req], logits: torch.Tensor | None = None, **kwargs: int
) -> tuple[list[int], torch.Tensor]:
    """Tokens and kept floors for reqs (one row each) over logits [len(reqs), V]."""
    if logits is None:
        logits = torch.stack([row_logits(r) for r in reqs])
    floor = torch.empty(len(reqs), device=DEVICE)
    tokens = sample(
        logits.to(DEVICE),
        torch.tensor([r.temperature for r in reqs]),
        torch.tensor([r.top_k for r in reqs], dtype=torch.int32),
        torch.tensor([r.top_p for r in reqs]),
        torch.tensor([r.min_p for r in reqs]),
        torch.tensor([r.seed for r in reqs], dtype=torch.int64),
        torch.tensor([r.offset for r in reqs], dtype=torch.int64),
        kept_floor=floor,
        block=kwargs.pop("block", BLOCK),
        **kwargs,
    )
    assert tokens.dtype == torch.int64 and tokens.shape == (len(reqs),)
    return tokens.tolist(), floor.cpu()


def reference_kept(logits: torch.Tensor, req: Req) -> set[int]:
    """The torch sampler's kept set for one row (the argmax for greedy rows)."""
    if req.temperature <= 0.0 or req.top_k == 1:
        return {int(torch.argmax(logits))}
    vocab = logits.shape[0]
    probs = torch.softmax(logits / max(req.temperature, 1e-5), dim=-1).unsqueeze(0)
    k = req.top_k if 0 < req.top_k < vocab else vocab
    kept = filter_probs_batch(
        probs, torch.tensor([k]), torch.tensor([req.top_p]), torch.tensor([req.min_p])
    )[0]
    return set((kept > 0).nonzero().flatten().tolist())


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def kept_by_floor(logits: torch.Tensor, floor: float) -> set[int]:
    return set((logits >= floor).nonzero().flatten().tolist())


def probs_of(req: Req) -> torch.Tensor:
    return torch.softmax(row_logits(req) / req.temperature, dim=-1)


def top_p_keeping(req: Req, n: int) -> float:
    """A top_p halfway between the masses that keep n - 1 and n tokens of what top-k and min-p
    keep, so the reference keeps exactly n whatever the rounding."""
    probs = probs_of(req)
    k = req.top_k if 0 < req.top_k < VOCAB else VOCAB
    kept = filter_probs_batch(
        probs.unsqueeze(0), torch.tensor([k]), torch.tensor([1.0]), torch.tensor([req.min_p])
    )[0]
    mass = torch.sort(kept, descending=True).values.double().cumsum(0)
    lower = mass[n - 2] if n >= 2 else 0.0
    return float((lower + mass[n - 1]) / 2 / mass[-1])


def min_p_keeping(req: Req, n: int) -> float:
    """A min_p halfway between the n-th and (n+1)-th probability, relative to the max."""
    ranked = torch.sort(probs_of(req), descending=True).values.double()
    return float((ranked[n - 1] + ranked[n]) / 2 / ranked[0])


def filter_cases() -> list[Req]:
    base = Req(logit_seed=11)
    cool = Req(temperature=0.6, logit_seed=12)
    hot = Req(temperature=1.7, logit_seed=13)
    k30 = replace(base, top_k=30)
    minp = replace(hot, min_p=min_p_keeping(hot, 40))
    return [
        Req(logit_seed=10),  # no filter: everything stays
        replace(base, top_k=5),
        replace(hot, top_k=50),
        replace(base, top_k=VOCAB - 1),
        replace(base, top_p=top_p_keeping(base, 1)),
        replace(cool, top_p=top_p_keeping(cool, 7)),
        replace(hot, top_p=top_p_keeping(hot, 180)),
        replace(base, min_p=min_p_keeping(base, 3)),
        minp,
        replace(k30, top_p=top_p_keeping(k30, 10)),
        replace(minp, top_p=top_p_keeping(minp, 6)),
        replace(minp, top_k=15),  # top-k binds
        replace(minp, top_k=60),  # min-p binds
        replace(cool, top_k=25, min_p=min_p_keeping(cool, 20), top_p=0.5),
        replace(base, temperature=0.0, top_k=5),  # greedy
        replace(base, top_k=1, top_p=0.3),  # greedy
    ]


# ---------------------------------------------------------------------------------- greedy


def tied_rows() -> torch.Tensor:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, [10, 700]] = 9.0  # tie across tiles: the first index wins
    logits[1, [301, 300]] = 9.0  # tie inside a tile
    logits[2] = 0.0  # all equal: index 0
    logits[3, :500] = float("-inf")  # masked vocab
    logits[4, VOCAB - 1] = 50.0  # in the ragged last tile
    return logits


def test_greedy_is_torch_argmax_with_first_index_on_ties() -> None:
    logits = tied_rows()
    want = torch.argmax(logits, dim=-1)
    assert want[:3].tolist() == [10, 300, 0]
    got = greedy(logits.to(DEVICE), block=BLOCK)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), want)
    out = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    assert greedy(logits.to(DEVICE), out, block=1024) is out
    assert torch.equal(out.cpu(), want)


def test_sample_takes_the_argmax_for_zero_temperature_and_top_k_one() -> None:
    logits = tied_rows()
    reqs = [
        Req(temperature=0.0, top_p=0.5, seed=1),
        Req(temperature=0.0, min_p=0.3),
        Req(temperature=1.0, top_k=1),
        Req(temperature=-1.0),
        Req(temperature=2.0, top_k=1, seed=9),
    ]
    tokens, floor = run(reqs, logits)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert torch.equal(floor, logits.max(dim=-1).values)


# --------------------------------------------------------------------------------- kept set


def test_kept_set_equals_the_reference_and_draws_stay_inside() -> None:
    cases = filter_cases()
    reqs = [replace(r, seed=i * (2**40 + 3)) for i, r in enumerate(cases)]
    tokens, floor = run(reqs)
    for i, req in enumerate(reqs):
        logits = row_logits(req)
        want = reference_kept(logits, req)
        assert kept_by_floor(logits, float(floor[i])) == want, req
        assert tokens[i] in want, req
    # The cases really cut: sizes as constructed.
    sizes = [len(reference_kept(row_logits(r), r)) for r in cases]
    assert sizes == [VOCAB, 5, 50, VOCAB - 1, 1, 7, 180, 3, 40, 10, 6, 15, 40, sizes[13], 1, 1]
    assert 1 < sizes[13] < 20


def test_draws_never_leave_a_tight_top_p_set() -> None:
    # A flat distribution cut to its top 3 of 1000 by top-p: the excluded tokens hold most of
    # the mass, so a wrong cut would show up within a few draws.
    req = Req(scale=0.3, logit_seed=21)
    req = replace(req, top_p=top_p_keeping(req, 3))
    want = reference_kept(row_logits(req), req)
    assert len(want) == 3
    tokens, _ = run([replace(req, seed=s, offset=s % 3) for s in range(12)])
    assert set(tokens) <= want
    assert len(set(tokens)) == 3  # and every kept token is reachable


def test_ties_at_a_cut_are_all_kept() -> None:
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, [3, 400, 650, 999]] = torch.tensor([2.0, 1.0, 1.0, 1.0])
    logits[:, 800] = 3.0
    p = torch.softmax(logits[0], dim=-1)
    # top-p reaching into the middle of the tie at 1.0: the reference's stable sort keeps the
    # tied tokens with the lower ids; the kernel keeps the whole tied group.
    mid_tie = float((p[800] + p[3] + 1.5 * p[400]) / p.sum())
    reqs = [
        Req(top_k=3),  # the 3rd largest is tied: top-k keeps all tied tokens (as torch does)
        Req(top_k=4, min_p=0.9 * float(p[400] / p[800])),
        Req(top_p=mid_tie),
    ]
    _, floor = run(reqs, logits)
    tied = {3, 400, 650, 800, 999}
    for i, req in enumerate(reqs[:2]):
        assert kept_by_floor(logits[i], float(floor[i])) == reference_kept(logits[i], req) == tied
    ref = reference_kept(logits[2], reqs[2])
    assert ref == {3, 400, 650, 800}
    assert kept_by_floor(logits[2], float(floor[2])) == tied


def test_extreme_knobs() -> None:
    logits = row_logits(Req(logit_seed=30)).repeat(4, 1)
    logits[3, 7] = float("-inf")
    reqs = [
        Req(min_p=1.0),  # only the max
        Req(min_p=5.0),  # clamped to 1: still the max, never an empty set
        Req(top_p=1e-9, top_k=VOCAB + 10),  # top-k beyond the vocab is off
        Req(temperature=1e-9),  # clamped temperature: the argmax, no NaN
    ]
    tokens, floor = run(reqs, logits)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert torch.equal(floor[:3], logits[:3].max(dim=-1).values)


# ------------------------------------------------------------------------------- streams


STREAM_REQS = [
    Req(seed=1, logit_seed=40, scale=0.5),
    Req(seed=1, logit_seed=40, scale=0.5, offset=1),
    Req(seed=2, logit_seed=41, top_k=20, top_p=0.9, scale=1.0),
    Req(seed=-7, logit_seed=42, min_p=0.3, scale=1.0, temperature=1.4),
    Req(seed=2**62, logit_seed=43, top_p=0.6, offset=2**33, scale=1.0),
    Req(temperature=0.0, logit_seed=44),
]


def test_a_row_does_not_depend_on_the_batch() -> None:
    alone = [run([r])[0][0] for r in STREAM_REQS]
    order = [4, 0, 5, 2, 1, 3]
    filler = [Req(seed=99, logit_seed=50, top_k=3), Req(logit_seed=51, top_p=0.5)]
    batch = [STREAM_REQS[i] for i in order[:3]] + filler + [STREAM_REQS[i] for i in order[3:]]
    tokens, _ = run(batch)
    together = tokens[:3] + tokens[5:]
    assert together == [alone[i] for i in order]


def test_tile_size_and_candidate_list_do_not_change_the_draw() -> None:
    # candidates=1 sends every filtered row through the whole-row fallback.
    want, want_floor = run(STREAM_REQS)
    for kwargs in ({"block": 1024}, {"block": 128, "candidates": 1}):
        got, floor = run(STREAM_REQS, **kwargs)
        assert got == want, kwargs
        assert torch.equal(floor, want_floor), kwargs


@pytest.mark.parametrize(
    "kwargs",
    [{"chunks": 2}, {"chunks": 4}, {"chunks": 8, "block": 64}, {"chunks": 2, "candidates": 1}],
    ids=["2", "4", "8_narrow", "2_overflow"],
)
def test_rows_spread_over_chunks_draw_what_one_program_draws(kwargs: dict) -> None:
    # candidates=1 overflows the chunks' regions: those rows take the whole-row path.
    want, want_floor = run(STREAM_REQS)
    got, floor = run(STREAM_REQS, **kwargs)
    assert got == want
    assert torch.equal(floor, want_floor)


KNOBS = st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 1.7]),  # temperature
    st.sampled_from([0, 1, 3, 40, 10_000]),  # top_k
    st.sampled_from([1.0, 0.95, 0.6, 0.1]),  # top_p
    st.sampled_from([0.0, 0.05, 0.5]),  # min_p
    st.integers(0, 2**40),  # seed
)


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(16, 700),
    chunks=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([32, 64, 128]),
    knobs=st.lists(KNOBS, min_size=1, max_size=4),
    data=st.data(),
)
def test_chunked_draws_equal_one_program_draws(
    vocab: int, chunks: int, block: int, knobs: list, data: st.DataObject
) -> None:
    # Any vocab against any tiling (chunks past the row's tiles get none), rows with masked
    # (-inf) tokens and exact ties, every filter mix: the chunks draw one program's tokens.
    rows = len(knobs)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    logits = torch.round(logits * 4) / 4  # coarse values: ties at the cuts
    masked = data.draw(st.lists(st.integers(0, vocab - 1), max_size=vocab // 2))
    logits[:, masked] = float("-inf")
    reqs = [Req(temperature=t, top_k=k, top_p=p, min_p=m, seed=s) for t, k, p, m, s in knobs]
    want, want_floor = run(reqs, logits, block=block, chunks=1)
    got, floor = run(reqs, logits, block=block, chunks=chunks)
    assert got == want
    assert torch.equal(floor, want_floor)


def test_chunked_greedy_takes_the_first_index_across_chunks() -> None:
    # 64-wide tiles over two chunks: index 70 lies in chunk 1's first tile, 130 in chunk 0's
    # second, so chunk 0 finds its max later in the row than chunk 1 does.
    logits = torch.zeros(2, 256)
    logits[:, [70, 130]] = 5.0
    logits[1, 200] = float("nan")
    reqs = [Req(temperature=0.0), Req(temperature=1.0, top_k=1)]
    tokens, floor = run(reqs, logits, block=64, chunks=2)
    assert tokens == [70, 70]
    assert floor.tolist() == [5.0, 5.0]


def test_offsets_move_the_stream_and_seeds_separate_streams() -> None:
    # 16 equally likely tokens: over 24 steps one stream should visit most of them.
    logits = torch.full((24, 64), -30.0)
    logits[:, 40:56] = 0.0
    steps = [Req(seed=5, offset=i) for i in range(24)]
    first, _ = run(steps, logits, block=64)
    assert set(first) <= set(range(40, 56))
    assert len(set(first)) >= 8
    assert sum(a == b for a, b in itertools.pairwise(first)) <= 6
    again, _ = run(steps, logits, block=64)
    assert again == first
    # Another seed, or the same offsets moved by 2**32 (the offset's high word), is another
    # stream: about 1 in 16 draws agree by chance.
    moved = [replace(r, seed=6) for r in steps[:12]] + [
        replace(r, offset=r.offset + 2**32) for r in steps[12:]
    ]
    other, _ = run(moved, logits, block=64)
    assert sum(a == b for a, b in zip(first, other, strict=True)) <= 6


# ----------------------------------------------------------------------------- frequencies

CHI2_CRIT = 18.4  # two degrees of freedom, p = 1e-4; fixed seeds make each run identical


def test_frequencies_follow_the_filtered_distribution() -> None:
    # T = 0.5 squares the odds, and min-p then drops the 4th token: a sampler that ignored
    # either would draw the 4th token or miss these frequencies far beyond the bound. Half the
    # draws go through the whole-row fallback (candidates=1): the two races share the count.
    target = torch.tensor([0.4, 0.3, 0.2, 0.1])
    ids = [5, 17, 40, 63]
    draws = 60
    logits = torch.full((draws, 64), float("-inf"))
    logits[:, ids] = torch.log(target)
    reqs = [Req(temperature=0.5, min_p=0.15, seed=1000 + i) for i in range(draws)]
    tokens = run(reqs, logits, block=64)[0] + run(reqs, logits, block=64, candidates=1)[0]
    counts = [tokens.count(t) for t in ids]
    assert counts[3] == 0 and sum(counts) == 2 * draws
    want = torch.softmax(torch.log(target) / 0.5, dim=-1)[:3]
    assert chi_square(counts[:3], (want / want.sum()).tolist()) < CHI2_CRIT, counts


# ------------------------------------------------------------------------------ contract


def test_strided_rows_and_out_buffer() -> None:
    reqs = [Req(seed=3, top_k=40, logit_seed=60), Req(seed=4, logit_seed=61, top_p=0.7)]
    wide = torch.full((2, VOCAB + 48), float("nan"))
    wide[:, 16 : 16 + VOCAB] = torch.stack([row_logits(r) for r in reqs])
    want, _ = run(reqs)
    strided = wide.to(DEVICE)[:, 16 : 16 + VOCAB]  # rows VOCAB + 48 apart
    out = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    knobs = [
        torch.tensor([r.temperature for r in reqs]),
        torch.tensor([r.top_k for r in reqs], dtype=torch.int32),
        torch.tensor([r.top_p for r in reqs]),
        torch.tensor([r.min_p for r in reqs]),
        torch.tensor([r.seed for r in reqs]),
        torch.tensor([r.offset for r in reqs]),
    ]
    assert sample(strided, *knobs, out, block=BLOCK) is out
    assert out.tolist() == want


def test_empty_batch_and_bad_arguments() -> None:
    empty = torch.zeros(0, VOCAB, device=DEVICE)
    knobs = [torch.zeros(0)] * 4 + [torch.zeros(0, dtype=torch.int64)] * 2
    assert sample(empty, *knobs).shape == (0,)
    logits = torch.zeros(2, VOCAB, device=DEVICE)
    knobs2 = [torch.zeros(2)] * 4 + [torch.zeros(2, dtype=torch.int64)] * 2
    with pytest.raises(TypeError, match="float32"):
        sample(logits.half(), *knobs2)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, torch.zeros(3), *knobs2[1:])
    with pytest.raises(ValueError, match="block"):
        sample(logits, *knobs2, block=100)
    with pytest.raises(ValueError, match="out"):
        sample(logits, *knobs2, out=torch.zeros(2, dtype=torch.int32, device=DEVICE))
