"""Triton lightning indexer on real shapes (4 index heads, Di 128, page 128, top-16, 1 local
block) against the fp32 torch reference, on the GPU.

Contexts up to 128K tokens (and one 1M-token decode row) over shuffled physical pages: decode at
batch 1 and 32, an 8-token verify step, 2K-token prefill chunks, a mixed batch, a CUDA-graph
replay with new metadata. (The decode scan's speed is measured by perf/bench_sparse_attention.py,
not asserted here.)

Tolerances are fractions of the row's score scale: |q[t, h]| * max |k| over the request's keys,
the Cauchy-Schwarz bound on any of its scores (~150 for unit-RMS elements at Di 128; the best
block of a 128K context scores ~50). Random data, so the row maximum would be a poor scale for
short contexts, whose few scores can sit near zero.
- kernel vs reference on the same cached keys (bf16 or fp8 widened to fp32): 1e-4. Both sum
  exact products in fp32; only the summation order differs.
- kernel vs the fp32 keys the cache was quantized from: bf16 1e-2; fp8 e4m3 4e-2. The torch
  reference alone, fp32 keys vs keys rounded to the cache dtype, on this data (128K and 1M
  contexts): max score error bf16 5e-4, fp8 9e-3 of the scale; worst near-tie violation of the
  quantized selection against the fp32 one: bf16 3e-4, fp8 5e-3.
- top-k "equal up to near-ties": every kept non-forced block scores >= the k-th best free score
  minus the tolerance, every left-out causal block <= it plus the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from m3serve.kernels import indexer as ref
from m3serve.kernels.paged import sequence_slots
from m3serve.kernels.triton.indexer import block_scores, index_topk, select_blocks
from m3serve.model.batch import ForwardBatch
from m3serve.runtime.messages import SeqStep

PAGE = 128
DI = 128
HEADS = 4
TOPK = 16
LOCAL = 1
K128 = 128 * 1024
M1 = 1024 * 1024
NEG_INF = float("-inf")
# Score tolerances as fractions of the row's score scale (see the module docstring).
EXACT_TOL = 1e-4
QUANT_TOL = {torch.bfloat16: 1e-2, torch.float8_e4m3fn: 4e-2}
KEY_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
# Reference scoring in query chunks keeps its [H, n, S] fp32 intermediate under ~0.5 GB.
REF_QUERY_CHUNK = 256


@pytest.fixture(autouse=True)
def exact_fp32_matmul() -> None:
    # The reference's fp32 einsum must not run in TF32.
    torch.backends.cuda.matmul.allow_tf32 = False


@dataclass
class Paged:
    q: torch.Tensor  # [T, H, Di]
    cache: torch.Tensor  # [pages * PAGE, Di] in the key dtype, NaN where no request wrote
    master: list[torch.Tensor]  # per request, the fp32 keys the cache was quantized from
    batch: ForwardBatch
    max_blocks: int

    def args(self) -> tuple:
        b = self.batch
        return (self.q, self.cache, b.page_table, b.seq_lens_t, b.extend_starts, b.positions)

    def cached_keys(self, row: int) -> torch.Tensor:
        b = self.batch
        slots = sequence_slots(b.page_table[row], b.seq_lens[row], PAGE)
        return bytes_view(self.cache)[slots].view(self.cache.dtype).float()


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 caches are gathered and scattered as uint8: index kernels need not support fp8."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def nan_cache(slots: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        # 0x7F is e4m3fn's NaN; filling through uint8 avoids relying on an fp8 fill kernel.
        return torch.full((slots, DI), 0x7F, dtype=torch.uint8, device="cuda").view(dtype)
    return torch.full((slots, DI), float("nan"), dtype=dtype, device="cuda")


def build(
    reqs: list[tuple[int, int]],
    key_dtype: torch.dtype,
    q_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    spare_pages: int = 7,
) -> Paged:
    """A batch of (seq_len, extend_len) requests over randomly permuted physical pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [-(-s // PAGE) for s, _ in reqs]
    total = sum(counts) + spare_pages
    order = torch.randperm(total, generator=gen, device="cuda").tolist()
    cache = nan_cache(total * PAGE, key_dtype)
    master, chunks, cursor = [], [], 0
    for (seq_len, ext), n in zip(reqs, counts, strict=True):
        pages, cursor = order[cursor : cursor + n], cursor + n
        # Unit-RMS elements, like Gemma-normed index keys: scores have std ~sqrt(Di).
        keys = torch.randn(seq_len, DI, generator=gen, device="cuda")
        slots = sequence_slots(torch.tensor(pages, device="cuda"), seq_len, PAGE)
        bytes_view(cache)[slots] = bytes_view(keys.to(key_dtype))
        master.append(keys)
        chunks.append(SeqStep([0] * ext, seq_len - ext, pages))
    batch = ForwardBatch.build(chunks, PAGE, "cuda")
    q = torch.randn(batch.num_tokens, HEADS, DI, generator=gen, device="cuda").to(q_dtype)
    return Paged(q, cache, master, batch, max(counts))


def one_request_reference(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference scores [n, H, num_blocks] and score scales [n, H, 1] of one request."""
    scores = torch.full((q.shape[0], HEADS, num_blocks), NEG_INF, device="cuda")
    for lo in range(0, q.shape[0], REF_QUERY_CHUNK):
        rows = slice(lo, lo + REF_QUERY_CHUNK)
        per = ref.block_scores(q[rows].float(), keys, positions[rows], PAGE)
        scores[rows, :, : per.shape[-1]] = per.permute(1, 0, 2)
    scale = q.float().norm(dim=-1, keepdim=True) * keys.norm(dim=-1).max()
    return scores, scale.clamp(min=1e-6)


def reference_scores(p: Paged, keys_of: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference scores [T, H, max_blocks] and scales [T, H, 1] from the cached keys ("cached")
    or from the fp32 keys they were quantized from ("master")."""
    b = p.batch
    scores = torch.empty(b.num_tokens, HEADS, p.max_blocks, device="cuda")
    scale = torch.empty(b.num_tokens, HEADS, 1, device="cuda")
    starts = b.extend_starts.tolist()
    for row in range(len(b.seq_lens)):
        keys = p.cached_keys(row) if keys_of == "cached" else p.master[row]
        rows = slice(starts[row], starts[row + 1])
        scores[rows], scale[rows] = one_request_reference(
            p.q[rows], keys, b.positions[rows], p.max_blocks
        )
    return scores, scale


def assert_scores_close(
    got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, tol: float
) -> None:
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected)), "-inf pattern differs"
    finite = ~torch.isneginf(expected)
    assert torch.isfinite(got[finite]).all(), "NaN/inf where the reference is finite"
    err = torch.where(finite, (got - expected).abs(), torch.zeros_like(got)) / scale
    assert err.max().item() <= tol, f"max error {err.max().item():.3g} of the score scale > {tol}"


def forced_mask(positions: torch.Tensor, num_blocks: int, local: int, init: int) -> torch.Tensor:
    """[T, num_blocks] the blocks each query must keep."""
    n = torch.arange(num_blocks, device=positions.device)[None, :]
    q_block = (positions // PAGE)[:, None]
    return (n <= q_block) & ((n > q_block - local) | (n < init))


def assert_topk_contract(
    ids: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    margin: torch.Tensor | float,
    local: int = LOCAL,
    init: int = 0,
) -> None:
    """ids [T, H, TOPK] against reference scores [T, H, NB]: the output contract (ascending
    valid prefix, -1 tail, no duplicates, causal, forced blocks kept, min(TOPK, visible)
    entries) and the choice of free blocks up to near-ties within margin ([T, H, 1] or 0)."""
    t_count, heads, k = ids.shape
    nb = scores.shape[-1]
    assert ids.dtype == torch.int32 and k == TOPK
    q_block = (positions // PAGE).to(torch.int64)
    expect_count = torch.clamp(q_block + 1, max=k)[:, None].expand(t_count, heads)
    valid = ids >= 0
    assert torch.equal(valid.sum(-1), expect_count), "wrong number of valid entries"
    slot = torch.arange(k, device=ids.device)
    assert torch.equal(valid, slot[None, None, :] < expect_count[..., None]), "-1 not a tail"
    ids64 = ids.long()
    assert (ids64 <= q_block[:, None, None]).all(), "a future block was selected"
    ascending = (ids64[..., 1:] > ids64[..., :-1]) | ~valid[..., 1:]
    assert ascending.all(), "valid ids are not strictly ascending (duplicates?)"

    kept = torch.zeros(t_count, heads, nb + 1, dtype=torch.bool, device=ids.device)
    kept.scatter_(-1, torch.where(valid, ids64, nb), True)
    kept = kept[..., :nb]
    forced = forced_mask(positions, nb, local, init)[:, None, :].expand_as(kept)
    assert (kept | ~forced).all(), "a forced block is missing"

    visible = (torch.arange(nb, device=ids.device)[None, :] <= q_block[:, None])[:, None, :]
    free = visible & ~forced
    room = expect_count - forced.sum(-1)
    ranked = torch.where(free, scores, NEG_INF).sort(-1, descending=True).values
    threshold = ranked.gather(-1, (room - 1).clamp(min=0)[..., None])
    has_room = (room > 0)[..., None]
    low_kept = kept & free & (scores < threshold - margin) & has_room
    high_left = ~kept & free & (scores > threshold + margin) & has_room
    assert not low_kept.any(), f"{int(low_kept.sum())} kept blocks are below the threshold"
    assert not high_left.any(), f"{int(high_left.sum())} left-out blocks beat the threshold"


def check_case(p: Paged, key_dtype: torch.dtype) -> None:
    """Scores against both references; selections against both, with the matching tolerance."""
    positions = p.batch.positions
    scores = block_scores(*p.args(), PAGE, p.max_blocks)
    ids = select_blocks(scores, positions, PAGE, TOPK, LOCAL)
    cached, scale = reference_scores(p, "cached")
    assert_scores_close(scores, cached, scale, EXACT_TOL)
    assert_topk_contract(ids, cached, positions, EXACT_TOL * scale)
    # The selection is exact on the kernel's own scores: ties only at equal values.
    assert_topk_contract(ids, scores, positions, 0.0)
    del cached
    master, scale = reference_scores(p, "master")
    tol = QUANT_TOL[key_dtype]
    assert_scores_close(scores, master, scale, tol)
    assert_topk_contract(ids, master, positions, tol * scale)
    # The fused entry point gives the same ids.
    assert torch.equal(index_topk(*p.args(), PAGE, TOPK, LOCAL, 0, p.max_blocks), ids)


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("seq_len", [1, 127, 128, 129, 2048, 2049, 40_000, K128])
def test_decode_batch1(seq_len: int, key_dtype: torch.dtype) -> None:
    check_case(build([(seq_len, 1)], key_dtype, seed=seq_len), key_dtype)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
def test_decode_batch1_one_million_tokens(key_dtype: torch.dtype) -> None:
    # 8192 pages: the top-k row spans the longest row the kernel is sized for.
    check_case(build([(M1 - 5, 1)], key_dtype, seed=11), key_dtype)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
def test_decode_batch32(key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(32)
    lens = [*torch.randint(1, K128 + 1, (30,), generator=gen).tolist(), K128, 3]
    check_case(build([(s, 1) for s in lens], key_dtype, seed=32), key_dtype)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
def test_verify_eight_tokens(key_dtype: torch.dtype) -> None:
    # Each of the 8 tokens has its own causal position (and page boundary crossings).
    reqs = [(8, 8), (2048 + 3, 8), (40_000, 8), (K128, 8), (130, 8)]
    check_case(build(reqs, key_dtype, seed=8), key_dtype)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("start", [0, K128 - 2048], ids=["fresh", "at-126K"])
def test_prefill_chunk_2k(start: int, key_dtype: torch.dtype) -> None:
    check_case(build([(start + 2048, 2048)], key_dtype, seed=start + 1), key_dtype)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["bf16", "fp8"])
def test_mixed_prefill_verify_decode_batch(key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    decodes = [(s, 1) for s in torch.randint(1, 64 * 1024, (29,), generator=gen).tolist()]
    reqs = [(96 * 1024 + 1000, 1000), *decodes, (50_000, 8), (700, 700)]
    check_case(build(reqs, key_dtype, seed=5), key_dtype)


def test_fp32_queries_use_exact_fp32_dot() -> None:
    p = build([(20_000, 8), (K128, 1)], torch.bfloat16, q_dtype=torch.float32, seed=3)
    scores = block_scores(*p.args(), PAGE, p.max_blocks)
    assert_scores_close(scores, *reference_scores(p, "cached"), EXACT_TOL)


def test_select_blocks_with_init_and_two_local_blocks() -> None:
    p = build([(K128, 8), (3000, 1)], torch.bfloat16, seed=6)
    cached, _ = reference_scores(p, "cached")
    ids = select_blocks(cached, p.batch.positions, PAGE, TOPK, 2, 1)
    assert_topk_contract(ids, cached, p.batch.positions, 0.0, local=2, init=1)


def test_cuda_graph_replay_with_new_metadata() -> None:
    """Captured once, replayed over batches with other lengths, pages and positions: the
    fixed grid must cover them all, reading the metadata only on the device."""
    num_reqs, max_blocks, pool_pages = 8, 256, 8 * 256 + 16
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache = torch.randn(pool_pages * PAGE, DI, generator=gen, device="cuda").to(torch.bfloat16)
    # The static inputs a captured decode step reads; refilled in place before each replay.
    q = torch.zeros(num_reqs, HEADS, DI, dtype=torch.bfloat16, device="cuda")
    page_table = torch.full((num_reqs, max_blocks), -1, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(num_reqs, dtype=torch.int32, device="cuda")
    extend_starts = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda")
    positions = torch.zeros(num_reqs, dtype=torch.int64, device="cuda")
    scores = torch.empty(num_reqs, HEADS, max_blocks, device="cuda")
    out = torch.empty(num_reqs, HEADS, TOPK, dtype=torch.int32, device="cuda")
    args = (q, cache, page_table, seq_lens, extend_starts, positions, PAGE, TOPK, LOCAL, 0)

    def load_batch(seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        lens = torch.randint(1, max_blocks * PAGE + 1, (num_reqs,), generator=g, device="cuda")
        pages = torch.randperm(pool_pages, generator=g, device="cuda")[: num_reqs * max_blocks]
        table = pages.view(num_reqs, max_blocks).to(torch.int32)
        used = torch.arange(max_blocks, device="cuda")[None, :] < (-(-lens // PAGE))[:, None]
        page_table.copy_(torch.where(used, table, -1))
        seq_lens.copy_(lens)
        positions.copy_(lens - 1)
        q.copy_(torch.randn(num_reqs, HEADS, DI, generator=g, device="cuda"))

    load_batch(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        index_topk(*args, max_blocks, scores=scores, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_topk(*args, max_blocks, scores=scores, out=out)

    for seed in (1, 2, 3):
        load_batch(seed)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert torch.equal(replayed, index_topk(*args, max_blocks))
        for row, seq_len in enumerate(seq_lens.tolist()):
            rows = slice(row, row + 1)
            keys = cache[sequence_slots(page_table[row], seq_len, PAGE)].float()
            expected, scale = one_request_reference(q[rows], keys, positions[rows], max_blocks)
            assert_scores_close(scores[rows], expected, scale, EXACT_TOL)
            assert_topk_contract(replayed[rows], expected, positions[rows], EXACT_TOL * scale)


def test_warm_call_does_not_synchronize() -> None:
    p = build([(K128, 1), (5000, 8)], torch.bfloat16, seed=9)
    index_topk(*p.args(), PAGE, TOPK, LOCAL, 0, p.max_blocks)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        index_topk(*p.args(), PAGE, TOPK, LOCAL, 0, p.max_blocks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
