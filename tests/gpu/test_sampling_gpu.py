"""The Triton sampler on the model's vocab (200064) and batch sizes 1, 64 and 256 (H200).

Rows mix greedy, plain-temperature and filtered requests over LLM-like logits (a Gaussian bulk
plus a few leading tokens). Greedy rows must equal torch.argmax; every draw must lie in the
torch reference's kept set (`filter_probs_batch`); where a row's knobs sit halfway between two
achievable cuts, the kept set read back through `kept_floor` must equal the reference's. Draws
are reproducible, independent of the batch and of the tuning knobs, replay from a CUDA graph,
and follow the filtered distribution on a peaked row. Timings against the torch sort-based
sampler are printed, not asserted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from m3serve.core.trace import CompileCounter
from m3serve.kernels.sampling import filter_probs_batch
from m3serve.kernels.triton.sampling import greedy, sample, warm_up

DEV = torch.device("cuda")
VOCAB = 200064
BATCHES = [1, 64, 256]


@dataclass
class Knobs:
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds, self.offsets)

    def rows(self, index: torch.Tensor) -> Knobs:
        return Knobs(*(t[index] for t in self.args()))


def llm_logits(batch: int, seed: int) -> torch.Tensor:
    """A Gaussian bulk with a spread that varies by row, and 1-8 leading tokens per row."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    spread = 1.0 + 2.0 * torch.rand(batch, 1, generator=gen, device=DEV)
    logits = torch.randn(batch, VOCAB, generator=gen, device=DEV) * spread
    for row in range(batch):
        lead = 1 + row % 8
        ids = torch.randint(0, VOCAB, (lead,), generator=gen, device=DEV)
        logits[row, ids] += 6.0 + 8.0 * torch.rand(lead, generator=gen, device=DEV)
    return logits


# (temperature, top_k, top_p, min_p) cycled over the rows; 0.95 top-p is the model's default.
CONFIGS = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 0.95, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 50, 1.0, 0.0),
    (1.0, 20, 0.9, 0.05),
    (1.3, 0, 1.0, 0.1),
    (0.8, 1, 1.0, 0.0),
    (1.0, 1000, 0.8, 0.0),
    (0.6, 0, 0.5, 0.02),
    (1.5, 200, 0.99, 0.0),
]


def mixed_knobs(batch: int, seed: int) -> Knobs:
    cfg = [CONFIGS[i % len(CONFIGS)] for i in range(batch)]
    return Knobs(
        torch.tensor([c[0] for c in cfg], device=DEV),
        torch.tensor([c[1] for c in cfg], dtype=torch.int32, device=DEV),
        torch.tensor([c[2] for c in cfg], device=DEV),
        torch.tensor([c[3] for c in cfg], device=DEV),
        torch.arange(batch, dtype=torch.int64, device=DEV) * 7919 + seed,
        torch.full((batch,), 3, dtype=torch.int64, device=DEV),
    )


def reference_probs(logits: torch.Tensor, knobs: Knobs) -> torch.Tensor:
    """The torch sampler's filtered (not renormalized) probabilities; greedy rows hold 0."""
    temperature = knobs.temperature.clamp_min(1e-5).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    k = knobs.top_k.long()
    k = torch.where((k > 0) & (k < VOCAB), k, VOCAB)
    return filter_probs_batch(probs, k, knobs.top_p, knobs.min_p)


def is_greedy(knobs: Knobs) -> torch.Tensor:
    return (knobs.temperature <= 0) | (knobs.top_k == 1)


def check_batch(logits: torch.Tensor, knobs: Knobs, tokens: torch.Tensor) -> None:
    greedy_rows = is_greedy(knobs)
    argmax = torch.argmax(logits, dim=-1)
    assert torch.equal(tokens[greedy_rows], argmax[greedy_rows])
    kept = reference_probs(logits, knobs) > 0
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    lowest_kept = torch.where(kept, logits, float("inf")).amin(dim=-1)
    # A draw is in the reference's set, or ties its lowest kept logit (the kernel keeps whole
    # tied groups at a top-p boundary).
    ok = kept.gather(1, tokens.unsqueeze(1)).squeeze(1) | (chosen >= lowest_kept)
    bad = (~ok & ~greedy_rows).nonzero().flatten().tolist()
    assert not bad, f"draws outside the kept set in rows {bad[:8]}"


@pytest.mark.parametrize("batch", BATCHES)
def test_greedy_and_kept_set_membership(batch: int) -> None:
    logits = llm_logits(batch, seed=batch)
    knobs = mixed_knobs(batch, seed=batch)
    tokens = sample(logits, *knobs.args())
    assert tokens.dtype == torch.int64 and tokens.shape == (batch,)
    check_batch(logits, knobs, tokens)
    assert torch.equal(greedy(logits), torch.argmax(logits, dim=-1))
    # Several more steps on the same logits: other draws, still inside.
    for step in range(4, 8):
        knobs.offsets.fill_(step)
        check_batch(logits, knobs, sample(logits, *knobs.args()))


def test_greedy_ties_take_the_first_index() -> None:
    logits = llm_logits(4, seed=5)
    logits[0, [7, VOCAB * 3 // 4]] = 100.0  # far apart: different tiles
    logits[1, [8193, 8194]] = 100.0  # neighbours
    logits[2] = 0.0
    logits[3, VOCAB - 1] = 100.0  # the ragged last tile
    want = torch.argmax(logits, dim=-1)
    assert want.tolist() == [7, 8193, 0, VOCAB - 1]
    assert torch.equal(greedy(logits), want)
    knobs = mixed_knobs(4, seed=0)
    knobs.temperature.zero_()
    assert torch.equal(sample(logits, *knobs.args()), want)


def midpoint_knobs(logits: torch.Tensor, seed: int) -> Knobs:
    """Filtered knobs whose cut falls inside each row's head (tokens holding >= 1e-4 of the
    mass) at a rank where the next probability is clearly smaller, with top-p and min-p
    halfway between the two achievable cuts: no rounding can move the boundary."""
    batch = logits.shape[0]
    gen = torch.Generator().manual_seed(seed)
    knobs = mixed_knobs(batch, seed)
    knobs.temperature.copy_(0.5 + torch.rand(batch, generator=gen).to(DEV))
    for row in range(batch):
        probs = torch.softmax(logits[row] / knobs.temperature[row], dim=-1).double()
        ranked = torch.sort(probs, descending=True).values
        head = int((ranked >= 1e-4).sum())
        # Ranks n (keep the top n) whose n-th and (n+1)-th probabilities differ by > 0.1%.
        gap = (ranked[:-1] - ranked[1:]) / ranked[:-1]
        ranks = ((gap[: max(head - 1, 0)] > 1e-3).nonzero().flatten() + 1).tolist()
        knobs.top_k[row], knobs.top_p[row], knobs.min_p[row] = 0, 1.0, 0.0
        kind = row % 3
        if kind == 0:
            ranks = [n for n in ranks if n > 1]  # top_k = 1 would be a greedy row
        if not ranks:
            knobs.top_k[row] = 1  # nothing safe to cut: a greedy row
            continue
        n = ranks[int(torch.randint(len(ranks), (1,), generator=gen))]
        if kind == 0:
            knobs.top_k[row] = n
        elif kind == 1:
            knobs.min_p[row] = float((ranked[n - 1] + ranked[n]) / 2 / ranked[0])
        else:
            mass = ranked.cumsum(0)
            below = mass[n - 2] if n >= 2 else 0.0
            knobs.top_p[row] = float((below + mass[n - 1]) / 2 / mass[-1])
    return knobs


@pytest.mark.parametrize("batch", [64])
def test_kept_set_equals_the_reference(batch: int) -> None:
    logits = llm_logits(batch, seed=11)
    knobs = midpoint_knobs(logits, seed=11)
    floor = torch.empty(batch, device=DEV)
    tokens = sample(logits, *knobs.args(), kept_floor=floor)
    check_batch(logits, knobs, tokens)
    probs = reference_probs(logits, knobs)
    sampled = ~is_greedy(knobs)
    positive = torch.softmax(logits / knobs.temperature.unsqueeze(1), dim=-1) > 0
    mine = (logits >= floor.unsqueeze(1)) & positive
    differ = ((mine != (probs > 0)).any(dim=-1) & sampled).nonzero().flatten().tolist()
    assert not differ, f"kept sets differ in rows {differ[:8]}"


def test_reproducible_and_independent_of_the_batch_and_tuning() -> None:
    logits = llm_logits(64, seed=21)
    knobs = mixed_knobs(64, seed=21)
    first = sample(logits, *knobs.args())
    assert torch.equal(sample(logits, *knobs.args()), first)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(DEV)
    assert torch.equal(sample(logits[perm], *knobs.rows(perm).args()), first[perm])
    for row in (0, 1, 4, 9):
        index = torch.tensor([row], device=DEV)
        alone = sample(logits[index], *knobs.rows(index).args())
        assert alone.item() == first[row].item()
    # Tile size, warps, the candidate list and the chunks a row is spread over are speed knobs
    # only; candidates=64 sends most filtered rows through the whole-row fallback. The default
    # spreads these 64 rows over 8 chunks each on an H100 or H200; chunks=1 is one program a row.
    variants = (
        {"block": 4096, "num_warps": 8},
        {"candidates": 64},
        {"block": 16384},
        {"chunks": 1},
        {"chunks": 16, "block": 1024, "num_warps": 4},
        {"chunks": 2, "candidates": 64},
    )
    for kwargs in variants:
        assert torch.equal(sample(logits, *knobs.args(), **kwargs), first), kwargs
    # The offset moves the stream.
    knobs.offsets.fill_(4)
    moved = sample(logits, *knobs.args())
    assert not torch.equal(moved[~is_greedy(knobs)], first[~is_greedy(knobs)])


def test_after_warm_up_no_batch_size_compiles() -> None:
    # Up to 263 rows spread over chunks (32 of them at 1-8 rows on an H100 or H200, 2 at
    # 135: an odd batch, whose scratch pieces must still start 16 bytes aligned), 300 rows take
    # one program a row: warm_up compiled both, for every chunk count.
    warm_up(VOCAB, DEV)
    counter = CompileCounter()
    try:
        for batch in (1, 3, 17, 64, 100, 135, 300):
            sample(llm_logits(batch, seed=batch), *mixed_knobs(batch, seed=batch).args())
        torch.cuda.synchronize()
        assert counter.names == []
    finally:
        counter.close()


def test_no_host_sync_and_cuda_graph_replay() -> None:
    logits = llm_logits(64, seed=31)
    knobs = mixed_knobs(64, seed=31)
    out = torch.empty(64, dtype=torch.int64, device=DEV)
    eager = sample(logits, *knobs.args()).clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, *knobs.args(), out=out)
        greedy(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, eager)
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, *knobs.args(), out=out)  # warm up (compile) outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            sample(logits, *knobs.args(), out=out)
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # The replay reads the offsets buffer in place: a new step, new draws.
    knobs.offsets.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sample(logits, *knobs.args()))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def chi2_bound(df: int) -> float:
    """About the p = 1e-4 critical value (Wilson-Hilferty); fixed seeds make runs identical."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 0.9), (0.8, 4, 1.0), (1.0, 0, 1.0)]
)
def test_frequencies_on_a_peaked_row(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator(device=DEV).manual_seed(41)
    row = torch.randn(VOCAB, generator=gen, device=DEV) * 2.0
    lead = torch.tensor([3, VOCAB // 3, VOCAB * 3 // 4 + 1, VOCAB - 1, 42, VOCAB // 2], device=DEV)
    row[lead] = torch.tensor([16.0, 15.5, 15.0, 14.5, 14.0, 13.0], device=DEV)
    batch, steps = 256, 16
    logits = row.expand(batch, VOCAB)
    knobs = Knobs(
        torch.full((batch,), temperature, device=DEV),
        torch.full((batch,), top_k, dtype=torch.int32, device=DEV),
        torch.full((batch,), top_p, device=DEV),
        torch.zeros(batch, device=DEV),
        torch.arange(batch, dtype=torch.int64, device=DEV) + 12345,
        torch.zeros(batch, dtype=torch.int64, device=DEV),
    )
    counts = torch.zeros(VOCAB, dtype=torch.float64, device=DEV)
    for step in range(steps):
        knobs.offsets.fill_(step)
        tokens = sample(logits, *knobs.args())
        counts += torch.bincount(tokens, minlength=VOCAB).double()
    probs = reference_probs(row.unsqueeze(0), knobs.rows(torch.tensor([0], device=DEV)))[0]
    probs = probs.double() / probs.sum()
    assert counts[probs == 0].sum() == 0
    # Cells: each lead token, and everything else kept lumped together.
    cells = [counts[lead], counts[probs > 0].sum(dim=0, keepdim=True) - counts[lead].sum()]
    want = [probs[lead], probs[probs > 0].sum(dim=0, keepdim=True) - probs[lead].sum()]
    got_c, want_p = torch.cat(cells), torch.cat(want)
    keep = want_p > 1e-3  # cells the filters emptied, or too small to test
    assert counts.sum() == batch * steps
    stat = chi_square(got_c[keep], want_p[keep] / want_p[keep].sum())
    assert stat < chi2_bound(int(keep.sum()) - 1), (got_c.tolist(), want_p.tolist())


def torch_sampler(logits: torch.Tensor, knobs: Knobs) -> torch.Tensor:
    """What the torch `Sampler` does for a batch of sampled rows (sort-based filters)."""
    probs = torch.softmax(logits / knobs.temperature.clamp_min(1e-5).unsqueeze(1), dim=-1)
    k = knobs.top_k.long()
    probs = filter_probs_batch(probs, torch.where(k > 0, k, VOCAB), knobs.top_p, knobs.min_p)
    noise = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
    return torch.argmax(probs / noise, dim=-1)


def time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize("batch", [1, 64, 256])
def test_print_timings(batch: int) -> None:
    logits = llm_logits(batch, seed=51)
    default = Knobs(
        torch.ones(batch, device=DEV),
        torch.zeros(batch, dtype=torch.int32, device=DEV),
        torch.full((batch,), 0.95, device=DEV),
        torch.zeros(batch, device=DEV),
        torch.arange(batch, dtype=torch.int64, device=DEV),
        torch.zeros(batch, dtype=torch.int64, device=DEV),
    )
    top_k = Knobs(*default.args())
    top_k.top_k = torch.full((batch,), 50, dtype=torch.int32, device=DEV)
    plain = Knobs(*default.args())
    plain.top_p = torch.ones(batch, device=DEV)
    lines = [f"\nsampling, B={batch}, V={VOCAB} (ms per call)"]
    for name, knobs in (("T=1 top_p=.95", default), ("+top_k=50", top_k), ("T=1 only", plain)):
        triton_ms = time_ms(lambda knobs=knobs: sample(logits, *knobs.args()))
        torch_ms = time_ms(lambda knobs=knobs: torch_sampler(logits, knobs))
        lines.append(f"  {name:14s} triton {triton_ms:7.3f}   torch sort {torch_ms:7.3f}")
    greedy_ms = time_ms(lambda: greedy(logits))
    argmax_ms = time_ms(lambda: torch.argmax(logits, dim=-1))
    lines.append(f"  {'greedy':14s} triton {greedy_ms:7.3f}   torch argmax {argmax_ms:7.3f}")
    print("\n".join(lines))
