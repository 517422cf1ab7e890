"""Triton lightning indexer (m3serve.kernels.triton.indexer) against the torch reference.

Tiny shapes (Di 16, 2 index heads, page 4, top-3) so the whole file runs in seconds under
TRITON_INTERPRET=1 on the CPU; real shapes live in tests/gpu/test_indexer_gpu.py. Batches mix a
decode token, an 8-token verify block and prefill chunks, built by ForwardBatch (the metadata the
engine really passes) over shuffled physical pages. Cache slots no request owns hold NaN, so a
kernel that reads past a request, or past a query's position, poisons its scores.
"""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE

from m3serve.kernels import indexer as ref
from m3serve.kernels.paged import sequence_slots
from m3serve.kernels.triton.indexer import block_scores, index_topk, select_blocks
from m3serve.model.batch import ForwardBatch
from m3serve.runtime.messages import SeqStep

DIM = 16
HEADS = 2
PAGE = 4
TOPK = 3
NEG_INF = float("-inf")

# (seq_len, extend_len) per request: decode, 8-token verify, mid-sequence prefill chunk.
MIXED = [(37, 1), (22, 8), (45, 13)]
# A fresh prefill (from position 0) next to a decode token.
PREFILL = [(29, 29), (18, 1)]


class Case:
    """One forward batch: index queries, a paged index-K cache and the device metadata."""

    def __init__(
        self,
        reqs: list[tuple[int, int]],
        key_dtype: torch.dtype = torch.float32,
        q_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        shuffle: bool = True,
        spare_pages: int = 5,
        extra_blocks: int = 2,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = [s for s, _ in reqs]
        self.extend_lens = [e for _, e in reqs]
        num_pages = sum(-(-s // PAGE) for s in self.seq_lens) + spare_pages
        # Its own generator: the same seed gives the same data shuffled or not.
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed + 1))
        order = perm.tolist() if shuffle else list(range(num_pages))
        chunks, cursor = [], 0
        self.keys = []
        cache = torch.full((num_pages * PAGE, DIM), float("nan"))
        for seq_len, ext in reqs:
            n = -(-seq_len // PAGE)
            pages, cursor = order[cursor : cursor + n], cursor + n
            keys = torch.randn(seq_len, DIM, generator=gen).to(key_dtype)
            self.keys.append(keys.float())
            slots = sequence_slots(torch.tensor(pages), seq_len, PAGE)
            cache[slots] = keys.float()
            chunks.append(SeqStep([0] * ext, seq_len - ext, pages))
        self.batch = ForwardBatch.build(chunks, PAGE, DEVICE)
        self.cache = cache.to(key_dtype).to(DEVICE)
        tokens = sum(self.extend_lens)
        self.q = torch.randn(tokens, HEADS, DIM, generator=gen).to(q_dtype).to(DEVICE)
        self.max_blocks = max(-(-s // PAGE) for s in self.seq_lens) + extra_blocks

    def args(self) -> tuple:
        b = self.batch
        return (self.q, self.cache, b.page_table, b.seq_lens_t, b.extend_starts, b.positions)

    def scores(self) -> torch.Tensor:
        return block_scores(*self.args(), PAGE, self.max_blocks)

    def ref_scores(self) -> torch.Tensor:
        """Reference [T, H, max_blocks] from the unpaged keys of each request."""
        out = torch.full((self.q.shape[0], HEADS, self.max_blocks), NEG_INF)
        start = 0
        for keys, ext in zip(self.keys, self.extend_lens, strict=True):
            rows = slice(start, start + ext)
            start += ext
            per = ref.block_scores(
                self.q[rows].cpu().float(), keys, self.batch.positions[rows].cpu(), PAGE
            )
            out[rows, :, : per.shape[-1]] = per.permute(1, 0, 2)
        return out

    def ref_topk(self, topk: int, local_blocks: int, init_blocks: int) -> torch.Tensor:
        b = self.batch
        return ref.paged_index_topk(
            self.q.cpu().float(),
            self.cache.cpu().float(),
            b.page_table.cpu(),
            b.seq_lens,
            b.extend_lens,
            b.positions.cpu(),
            PAGE,
            topk,
            local_blocks,
            init_blocks,
        )


def valid_set(ids: torch.Tensor) -> set[int]:
    return {int(i) for i in ids if i >= 0}


def check_contract(ids: torch.Tensor, positions: torch.Tensor, topk: int, forced: int) -> None:
    """Valid prefix in ascending order, -1 tail, no duplicates, causal, local block present,
    min(topk, visible blocks) entries."""
    for t, pos in enumerate(positions.tolist()):
        q_block = pos // PAGE
        for h in range(ids.shape[1]):
            row = ids[t, h].tolist()
            valid = [b for b in row if b >= 0]
            assert row == valid + [-1] * (topk - len(valid)), row
            assert valid == sorted(set(valid)), row
            assert all(b <= q_block for b in valid)
            assert q_block in valid
            assert len(valid) == min(topk, q_block + 1)
            assert len(valid) >= min(forced, q_block + 1)


def assert_topk_near_ties(
    ids: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    local_blocks: int,
    tol: float,
) -> None:
    """Equal up to near-ties: beyond the forced blocks, every kept block scores >= the k-th best
    free score - tol and every causal block left out scores <= it + tol."""
    for t, pos in enumerate(positions.tolist()):
        q_block = pos // PAGE
        forced = {max(q_block - i, 0) for i in range(local_blocks)}
        for h in range(ids.shape[1]):
            kept = valid_set(ids[t, h])
            assert forced <= kept
            free = sorted(
                (float(scores[t, h, b]) for b in range(q_block + 1) if b not in forced),
                reverse=True,
            )
            room = min(topk, q_block + 1) - len(forced)
            if room <= 0 or not free:
                continue
            threshold = free[room - 1]
            for b in range(q_block + 1):
                if b in forced:
                    continue
                if b in kept:
                    assert float(scores[t, h, b]) >= threshold - tol, (t, h, b)
                else:
                    assert float(scores[t, h, b]) <= threshold + tol, (t, h, b)


# --------------------------------------------------------------------------------- scores


@pytest.mark.parametrize(
    ("reqs", "key_dtype", "q_dtype"),
    [
        (MIXED, torch.float32, torch.float32),
        (MIXED, torch.bfloat16, torch.bfloat16),
        (MIXED, torch.float8_e4m3fn, torch.bfloat16),
        (PREFILL, torch.float32, torch.float32),
    ],
    ids=["mixed-fp32", "mixed-bf16", "mixed-fp8", "prefill-fp32"],
)
def test_scores_equal_reference_block_max(
    reqs: list[tuple[int, int]], key_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    case = Case(reqs, key_dtype, q_dtype, seed=len(reqs))
    got = case.scores().cpu()
    expected = case.ref_scores()
    assert got.shape == (sum(case.extend_lens), HEADS, case.max_blocks)
    assert got.dtype == torch.float32
    # -inf exactly where the reference has it: future pages, pages past the request, padding.
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    assert torch.isfinite(got[~torch.isneginf(got)]).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_causal_partial_page_ignores_keys_after_the_query() -> None:
    # Decode token at position 5 in page 1 (keys 4..7): keys 6 and 7 are its future. The page
    # also holds keys 6 and 7 for the verify token at position 7, which must see them.
    case = Case([(8, 3)], seed=3, extra_blocks=0)
    planted = torch.zeros(8, DIM)
    planted[:, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1000.0, 2000.0])
    pages = case.batch.page_table[0].cpu()
    case.cache[sequence_slots(pages, 8, PAGE).to(DEVICE)] = planted.to(DEVICE)
    case.q.zero_()
    case.q[:, :, 0] = 1.0
    got = case.scores().cpu()
    assert got[:, 0].tolist() == [[3.0, 5.0], [3.0, 1000.0], [3.0, 2000.0]]


def test_padding_rows_after_the_last_request_are_minus_inf() -> None:
    # A CUDA-graph bucket pads T past extend_starts[B]: those rows are written, all -inf.
    case = Case([(21, 1), (13, 2)], seed=4)
    b = case.batch
    pad = 5
    q = torch.cat([case.q, torch.randn(pad, HEADS, DIM, device=DEVICE)])
    positions = torch.cat([b.positions, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    out = torch.full((q.shape[0], HEADS, case.max_blocks), 7.0, device=DEVICE)
    got = block_scores(
        q,
        case.cache,
        b.page_table,
        b.seq_lens_t,
        b.extend_starts,
        positions,
        PAGE,
        case.max_blocks,
        out=out,
    )
    assert got is out
    assert torch.isneginf(got[-pad:]).all()
    torch.testing.assert_close(got[:-pad].cpu(), case.ref_scores(), rtol=1e-5, atol=1e-5)


def test_shuffled_pages_score_like_contiguous_pages() -> None:
    shuffled = Case(MIXED, seed=5, shuffle=True)
    contiguous = Case(MIXED, seed=5, shuffle=False)
    assert not torch.equal(shuffled.batch.page_table, contiguous.batch.page_table)
    torch.testing.assert_close(shuffled.scores(), contiguous.scores(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reqs", [[(37, 1), (22, 1)], MIXED], ids=["decode", "mixed"])
def test_scores_do_not_depend_on_the_pages_a_program_streams(reqs: list[tuple[int, int]]) -> None:
    # The launch splits a tile's pages among programs (one page a program at decode, two or
    # more for prefill tiles and large grids); a page's score is one program's dot either way.
    case = Case(reqs, seed=6)
    served = case.scores()
    for pages in (1, 2, 3, 8):
        got = block_scores(*case.args(), PAGE, case.max_blocks, pages_per_program=pages)
        assert torch.equal(got, served), f"{pages} pages a program"


# ------------------------------------------------------------------------------ selection


@pytest.mark.parametrize(("local_blocks", "init_blocks"), [(1, 0), (2, 0), (1, 1), (2, 1)])
def test_selection_equals_reference_sets(local_blocks: int, init_blocks: int) -> None:
    case = Case(MIXED, seed=10 + 3 * local_blocks + init_blocks)
    b = case.batch
    ids = index_topk(*case.args(), PAGE, TOPK, local_blocks, init_blocks, case.max_blocks)
    assert ids.shape == (sum(case.extend_lens), HEADS, TOPK)
    assert ids.dtype == torch.int32
    ids = ids.cpu()
    expected = case.ref_topk(TOPK, local_blocks, init_blocks)
    check_contract(ids, b.positions.cpu(), TOPK, local_blocks + init_blocks)
    for t in range(ids.shape[0]):
        for h in range(HEADS):
            assert valid_set(ids[t, h]) == valid_set(expected[t, h]), (t, h)
    # The batch does exercise dropping: some rows see more blocks than topk.
    assert (b.positions.cpu() // PAGE + 1 > TOPK).any()


def test_prefill_selection_with_more_slots_than_blocks_pads_minus_one() -> None:
    # topk 5 over a 29-token prefill: early tokens see 1..4 blocks and pad with -1.
    case = Case(PREFILL, seed=20)
    ids = index_topk(*case.args(), PAGE, 5, 1, 0, case.max_blocks).cpu()
    check_contract(ids, case.batch.positions.cpu(), 5, 1)
    expected = case.ref_topk(5, 1, 0)
    for t in range(ids.shape[0]):
        for h in range(HEADS):
            assert valid_set(ids[t, h]) == valid_set(expected[t, h])
    assert ids[0, 0].tolist() == [0, -1, -1, -1, -1]


@pytest.mark.parametrize("radix_bits", [1, 2, 4, 8])
def test_select_blocks_matches_reference_on_random_rows(radix_bits: int) -> None:
    gen = torch.Generator().manual_seed(30)
    tokens, num_blocks = 24, 40
    positions = torch.randint(0, num_blocks * PAGE, (tokens,), generator=gen)
    scores = torch.randn(tokens, HEADS, num_blocks, generator=gen)
    future = torch.arange(num_blocks)[None, :] > (positions // PAGE)[:, None]
    scores = scores.masked_fill(future[:, None, :], NEG_INF)
    for topk, local_blocks, init_blocks in [(3, 1, 0), (6, 2, 1), (1, 1, 0)]:
        got = select_blocks(
            scores.to(DEVICE), positions.to(DEVICE), PAGE, topk, local_blocks, init_blocks,
            radix_bits=radix_bits,
        ).cpu()  # fmt: skip
        expected = ref.select_blocks(
            scores.permute(1, 0, 2), positions, PAGE, topk, local_blocks, init_blocks
        )
        check_contract(got, positions, topk, local_blocks + init_blocks)
        for t in range(tokens):
            for h in range(HEADS):
                assert valid_set(got[t, h]) == valid_set(expected[t, h]), (topk, t, h)


def test_forced_blocks_win_over_higher_scores() -> None:
    # Query in block 7: local block 7 and init block 0 score lowest but are kept.
    scores = torch.tensor([[[-50.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, -60.0, NEG_INF]]])
    positions = torch.tensor([30])
    got = select_blocks(scores.to(DEVICE), positions.to(DEVICE), PAGE, 3, 1, 1).cpu()
    assert got[0, 0].tolist() == [0, 1, 7]
    got = select_blocks(scores.to(DEVICE), positions.to(DEVICE), PAGE, 3, 2, 0).cpu()
    assert got[0, 0].tolist() == [1, 6, 7]


@pytest.mark.parametrize("radix_bits", [1, 2, 4])
def test_exact_ties_go_to_the_lowest_block_ids(radix_bits: int) -> None:
    # Blocks 2, 3, 5 tie for the last two free slots: the two lowest ids win, every time.
    scores = torch.tensor([[[1.0, 9.0, 4.0, 4.0, 0.5, 4.0, 2.0]]])
    positions = torch.tensor([27])
    for _ in range(2):
        got = select_blocks(
            scores.to(DEVICE), positions.to(DEVICE), PAGE, 4, 1, 0, radix_bits=radix_bits
        ).cpu()
        assert got[0, 0].tolist() == [1, 2, 3, 6]


def test_near_tie_selection_is_within_threshold_tolerance() -> None:
    # Blocks 1 and 4 differ by one fp32 ulp: either may take the last slot, nothing else may.
    # Planted keys make the block maxima exact: key row = score * e0, query = e0.
    case = Case([(28, 1)], seed=40, extra_blocks=0)
    base = torch.tensor([0.5, 3.0, -1.0, 2.0, 3.0, -2.0, 0.0])
    base[4] = torch.nextafter(base[1], torch.tensor(4.0))
    keys = torch.zeros(28, DIM)
    keys[:, 0] = -10.0
    keys[torch.arange(7) * PAGE, 0] = base
    slots = sequence_slots(case.batch.page_table[0].cpu(), 28, PAGE)
    case.cache[slots.to(DEVICE)] = keys.to(DEVICE)
    case.q.zero_()
    case.q[:, :, 0] = 1.0
    scores = case.scores()
    ids = select_blocks(scores, case.batch.positions, PAGE, TOPK, 1, 0).cpu()
    assert_topk_near_ties(ids, scores.cpu(), case.batch.positions.cpu(), TOPK, 1, tol=1e-5)
    kept = valid_set(ids[0, 0])
    assert 6 in kept and (1 in kept or 4 in kept) and len(kept) == TOPK


def test_out_buffer_is_filled_in_place() -> None:
    case = Case(MIXED, seed=50)
    out = torch.full((sum(case.extend_lens), HEADS, TOPK), 99, dtype=torch.int32, device=DEVICE)
    scores = torch.empty(sum(case.extend_lens), HEADS, case.max_blocks, device=DEVICE)
    got = index_topk(*case.args(), PAGE, TOPK, 1, 0, case.max_blocks, scores=scores, out=out)
    assert got is out
    assert (out != 99).all()
    torch.testing.assert_close(scores.cpu(), case.ref_scores(), rtol=1e-5, atol=1e-5)
