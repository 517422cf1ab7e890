"""Triton paged attention at the model's real shapes on the GPU, against the fp32 torch reference.

Hq 64, Hkv 4, D 128, page 128, top-16 pages per (token, index head), 4 index heads. Contexts up
to 128K tokens on shuffled physical pages; every slot no request owns (spare pages and the tail
of each request's last page) is NaN so a stray read shows up, and every output buffer starts as
NaN so an unwritten element shows up.

Tolerances, as ‖out − ref‖ / ‖ref‖ with ref the reference in fp32 on the same cache values:
bf16 1e-2 (bf16 P·V operands and the bf16 output rounding, ~3e-3 in practice). For an fp8 cache
the same 1e-2 holds against the reference on the dequantized values (the kernel's own error),
and FP8_VS_BF16 bounds the total against the reference on the bf16 cache the fp8 one was cast
from. E4M3 rounding of K and V alone accounts for 5.9-6.9 % there at these shapes (measured with
the torch reference, q·k logits of std ≈ 2), so the bound is 1e-1, not 6e-2.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.attention_batch import AttentionBatch

from m3serve.kernels.attention import paged_attention as reference
from m3serve.kernels.triton.attention import AttentionConfig, paged_attention

NUM_Q, NUM_KV, NUM_IDX, HEAD_DIM, PAGE, TOPK = 64, 4, 4, 128, 128, 16
SCALE = HEAD_DIM**-0.5
BF16_TOL = 1e-2
FP8_VS_BF16 = 1e-1
REF_ROWS = 128  # reference query rows per call: keeps its [H, rows, S] fp32 scores ≤ ~2 GB


def random_selection(positions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[T, NUM_IDX, TOPK] valid top-k: the local page plus random distinct earlier pages."""
    local = positions // PAGE
    blocks = int(local.max()) + 1
    score = torch.rand(positions.shape[0], NUM_IDX, blocks, device="cuda", generator=gen)
    history = torch.arange(blocks, device="cuda")[None, None, :] < local[:, None, None]
    score = torch.where(history, score, -1.0)
    vals, idx = score.topk(min(TOPK - 1, blocks), dim=-1)
    idx = torch.where(vals >= 0, idx, -1)
    ids = torch.cat([local[:, None, None].expand(-1, NUM_IDX, 1), idx], dim=-1)
    if ids.shape[-1] < TOPK:
        ids = torch.nn.functional.pad(ids, (0, TOPK - ids.shape[-1]), value=-1)
    # Half the rows keep the local page first (HF order), half move it to the end (MSA order).
    flip = torch.arange(ids.shape[0], device="cuda") % 2 == 1
    valid = (ids >= 0).sum(-1, keepdim=True)
    rolled = torch.gather(ids, -1, (torch.arange(TOPK, device="cuda") + 1) % valid.clamp(min=1))
    rolled = torch.where(torch.arange(TOPK, device="cuda") < valid, rolled, -1)
    return torch.where(flip[:, None, None], rolled, ids).to(torch.int32)


def make_batch(
    requests: list[tuple[int, int]], *, sparse: bool, seed: int, owned_extra: int = 0
) -> AttentionBatch:
    """requests: (seq_len, extend_len). Slots past seq_len + owned_extra are NaN."""
    cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [s for s, _ in requests]
    extend_lens = [e for _, e in requests]
    counts = [-(-(s + owned_extra) // PAGE) for s in seq_lens]
    total = sum(counts) + 7
    order = torch.randperm(total, generator=cpu)
    table = torch.full((len(requests), max(counts)), -1, dtype=torch.int32)
    owned = torch.zeros(total * PAGE, dtype=torch.bool)
    cursor = 0
    for row, (seq_len, count) in enumerate(zip(seq_lens, counts, strict=True)):
        pages = order[cursor : cursor + count]
        cursor += count
        table[row, :count] = pages.to(torch.int32)
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)
        owned[slots[: seq_len + owned_extra]] = True
    shape = (total * PAGE, NUM_KV, HEAD_DIM)
    owned = owned.to("cuda")[:, None, None]
    nan = torch.tensor(float("nan"), device="cuda", dtype=torch.bfloat16)
    k_cache = torch.where(owned, torch.randn(shape, device="cuda", generator=gen).bfloat16(), nan)
    v_cache = torch.where(owned, torch.randn(shape, device="cuda", generator=gen).bfloat16(), nan)
    positions = torch.cat([torch.arange(s - e, s) for s, e in requests]).to("cuda")
    # ×2 makes the attention peakier than N(0, 1) logits, closer to a trained model's.
    q = (
        2 * torch.randn(positions.shape[0], NUM_Q, HEAD_DIM, device="cuda", generator=gen)
    ).bfloat16()
    ids = random_selection(positions, gen) if sparse else None
    return AttentionBatch(
        q, k_cache, v_cache, table.to("cuda"), seq_lens, extend_lens, positions, ids
    )


def run(
    batch: AttentionBatch, config: AttentionConfig | None = None, decode_rows: int = 0
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        batch.seq_lens_t,
        batch.extend_starts,
        batch.positions,
        PAGE,
        SCALE,
        batch.block_ids,
        max(batch.extend_lens),
        out=out,
        decode_rows=decode_rows,
        config=config,
    )
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    return out


def expected(batch: AttentionBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The reference in fp32, request by request on compact copies of its pages, REF_ROWS query
    rows per call. rows: the subset of rows to compute (all when None), in order."""
    starts = batch.extend_starts.tolist()
    wanted = torch.arange(batch.q.shape[0], device="cuda") if rows is None else rows
    parts = []
    for req, seq_len in enumerate(batch.seq_lens):
        mine = wanted[(wanted >= starts[req]) & (wanted < starts[req + 1])]
        if mine.numel() == 0:
            continue
        n_pages = -(-seq_len // PAGE)
        pages = batch.page_table[req, :n_pages].long()
        k = gather_pages(batch.k_cache, pages)
        v = gather_pages(batch.v_cache, pages)
        table = torch.arange(n_pages, device="cuda", dtype=torch.int32)[None]
        for chunk in mine.split(REF_ROWS):
            ids = None if batch.block_ids is None else batch.block_ids[chunk]
            q = batch.q[chunk].float()
            pos = batch.positions[chunk]
            parts.append(reference(q, k, v, table, [seq_len], [len(chunk)], pos, PAGE, SCALE, ids))
    return torch.cat(parts)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """One request's pages, in logical order, as a compact fp32 cache."""
    # Gather the raw bytes: indexing kernels need not cover float8 dtypes.
    raw = cache.view(torch.uint8).view(-1, PAGE, NUM_KV, HEAD_DIM * cache.element_size())
    return raw[pages].flatten(0, 1).view(cache.dtype).float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def check(
    batch: AttentionBatch,
    config: AttentionConfig | None = None,
    fp8: bool = False,
    decode_rows: int = 0,
) -> None:
    want_bf16 = expected(batch)
    if fp8:
        batch = batch.as_fp8()
    got = run(batch, config, decode_rows)
    want = expected(batch) if fp8 else want_bf16
    err = rel_err(got, want)
    assert err <= BF16_TOL, f"relative error {err:.2e} against the reference"
    if fp8:
        quant = rel_err(got, want_bf16)
        assert quant <= FP8_VS_BF16, f"fp8 relative error {quant:.2e} against the bf16 cache"


DECODE = AttentionConfig(path="decode")
PREFILL = AttentionConfig(path="prefill")
SPARSE = pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])


# --------------------------------------------------------------------------------- tests


@SPARSE
def test_decode_batch1_at_128k(sparse: bool) -> None:
    check(make_batch([(131072 - 37, 1)], sparse=sparse, seed=1))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_batch32_up_to_128k(fp8: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    contexts = torch.randint(1, 131072, (32,), generator=gen).tolist()
    contexts[:3] = [131072, 1, 129]  # the full 128K, a first token, one past a page boundary
    check(make_batch([(c, 1) for c in contexts], sparse=True, seed=2), fp8=fp8)


def test_dense_decode_batch32() -> None:
    gen = torch.Generator().manual_seed(3)
    contexts = torch.randint(1, 32768, (32,), generator=gen).tolist()
    check(make_batch([(c, 1) for c in contexts], sparse=False, seed=3))


@SPARSE
@pytest.mark.parametrize("config", [None, PREFILL], ids=["auto", "prefill"])
def test_verify_8_tokens(sparse: bool, config: AttentionConfig | None) -> None:
    requests = [(131072, 8), (70001, 8), (4100, 8), (9, 8)]
    check(make_batch(requests, sparse=sparse, seed=4), config)


@pytest.mark.parametrize(
    ("sparse", "fp8"), [(True, False), (True, True), (False, False)], ids=["sparse", "fp8", "dense"]
)
def test_prefill_2k_chunk_at_64k(sparse: bool, fp8: bool) -> None:
    check(make_batch([(65536 + 77, 2048)], sparse=sparse, seed=5), fp8=fp8)


@SPARSE
@pytest.mark.parametrize("config", [None, DECODE], ids=["auto", "decode"])
def test_mixed_batch(sparse: bool, config: AttentionConfig | None) -> None:
    # A mid-page prefill chunk, a whole short prompt, decode tokens and verify blocks together.
    requests = [(20000 + 50, 300), (77, 77), (5000, 1), (128, 1), (40961, 8), (100000, 1)]
    check(make_batch(requests, sparse=sparse, seed=6), config)


@SPARSE
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mixed_step_decode_rows_take_the_decode_kernel(sparse: bool, fp8: bool) -> None:
    # A served mixed step: 64 decode rows (contexts up to 40K) in front of a 256-token chunk
    # after a cached prefix and a short whole prompt; the decode rows go to the decode kernel.
    contexts = [1024 + 613 * i for i in range(64)]
    requests = [(c, 1) for c in contexts] + [(4096 + 256, 256), (40, 40)]
    split = AttentionConfig(mixed_decode_min_rows=1)
    check(make_batch(requests, sparse=sparse, seed=11), split, fp8=fp8, decode_rows=64)


@pytest.mark.parametrize("splits", [1, 5, 64])
def test_explicit_split_counts(splits: int) -> None:
    batch = make_batch([(131072, 1), (3000, 1), (50000, 2)], sparse=True, seed=7)
    check(batch, AttentionConfig(path="decode", num_splits=splits))


@SPARSE
def test_decode_replays_in_a_cuda_graph(sparse: bool) -> None:
    """Capture one decode step, update the metadata in place, replay: the next step's result."""
    contexts = [131000, 4097, 77777, 12, 65536, 300, 99999, 2048]
    batch = make_batch([(c, 1) for c in contexts], sparse=sparse, seed=8, owned_extra=1)
    seq_lens_t, starts = batch.seq_lens_t, batch.extend_starts
    out = torch.empty_like(batch.q)

    def step() -> None:
        paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.page_table, seq_lens_t, starts,
            batch.positions, PAGE, SCALE, batch.block_ids, 1, out=out,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # The next step: every request one token longer, new queries, new selections.
    gen = torch.Generator(device="cuda").manual_seed(9)
    batch.positions.add_(1)
    seq_lens_t.add_(1)
    batch.seq_lens = [c + 1 for c in contexts]
    batch.q.copy_(2 * torch.randn(batch.q.shape, device="cuda", generator=gen))
    if batch.block_ids is not None:
        batch.block_ids.copy_(random_selection(batch.positions, gen))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    err = rel_err(out, expected(batch))
    assert err <= BF16_TOL, f"relative error {err:.2e} after replay"


def test_128k_prefill_rows_subset() -> None:
    """A 1K-token chunk ending at 128K, checked on a sample of rows (the full reference is big)."""
    batch = make_batch([(131072, 1024)], sparse=True, seed=10)
    got = run(batch)
    rows = torch.arange(0, 1024, 7, device="cuda")
    err = rel_err(got[rows], expected(batch, rows))
    assert err <= BF16_TOL, f"relative error {err:.2e}"
