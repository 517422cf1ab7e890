"""Triton paged attention (m3serve.kernels.triton.attention) against the torch reference.

Tiny shapes (D 16, 2 KV heads × 2 query heads each, page 4) so the whole file runs in seconds
under TRITON_INTERPRET=1 on the CPU. Every case uses shuffled physical pages, a cache that is
NaN in every slot no request owns (a stray read poisons the output) and a NaN-poisoned output
buffer (an unwritten element fails the test).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.attention_batch import AttentionBatch
from helpers.devices import DEVICE

import m3serve.kernels.triton.attention as attention_module
from m3serve.kernels.attention import paged_attention as reference
from m3serve.kernels.triton.attention import AttentionConfig, paged_attention

HEAD_DIM = 16
NUM_KV = 2
GROUP = 2
PAGE = 4
TOPK = 3
SCALE = HEAD_DIM**-0.5
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def make_batch(
    requests: list[tuple[int, int]],
    *,
    sparse: bool,
    q_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    num_idx_heads: int = NUM_KV,
    topk: int = TOPK,
    seed: int = 0,
) -> AttentionBatch:
    """requests: (seq_len, extend_len) pairs; the new tokens are the last extend_len of each."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or q_dtype
    seq_lens = [s for s, _ in requests]
    extend_lens = [e for _, e in requests]
    page_counts = [-(-s // PAGE) for s in seq_lens]
    total_pages = sum(page_counts) + 3  # spare pages nobody owns stay NaN
    order = torch.randperm(total_pages, generator=gen).tolist()
    shape = (total_pages * PAGE, NUM_KV, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    table = torch.full((len(requests), max(page_counts) + 1), -1, dtype=torch.int32)
    cursor = 0
    for row, (seq_len, count) in enumerate(zip(seq_lens, page_counts, strict=True)):
        pages = order[cursor : cursor + count]
        cursor += count
        table[row, :count] = torch.tensor(pages, dtype=torch.int32)
        for pos in range(seq_len):  # slots past seq_len in the last page stay NaN
            slot = pages[pos // PAGE] * PAGE + pos % PAGE
            k_cache[slot] = torch.randn(NUM_KV, HEAD_DIM, generator=gen)
            v_cache[slot] = torch.randn(NUM_KV, HEAD_DIM, generator=gen)
    positions = torch.cat([torch.arange(s - e, s) for s, e in requests])
    q = torch.randn(positions.shape[0], NUM_KV * GROUP, HEAD_DIM, generator=gen)
    block_ids = None
    if sparse:
        block_ids = torch.full((positions.shape[0], num_idx_heads, topk), -1, dtype=torch.int32)
        for t, pos in enumerate(positions.tolist()):
            local = pos // PAGE
            for h in range(num_idx_heads):
                history = torch.randperm(local, generator=gen)[: topk - 1].tolist()
                chosen = [local, *history]
                # A selection is a set: put the local page anywhere, not always first or last.
                perm = torch.randperm(len(chosen), generator=gen).tolist()
                chosen = [chosen[i] for i in perm]
                block_ids[t, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return AttentionBatch(
        q=q.to(q_dtype).to(DEVICE),
        k_cache=k_cache.to(kv_dtype).to(DEVICE),
        v_cache=v_cache.to(kv_dtype).to(DEVICE),
        page_table=table.to(DEVICE),
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        positions=positions.to(DEVICE),
        block_ids=None if block_ids is None else block_ids.to(DEVICE),
    )


def run(
    batch: AttentionBatch, config: AttentionConfig | None = None, decode_rows: int = 0
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention(
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
    assert got is out
    assert not out.isnan().any(), "an output element was not written"
    return out


def expected(batch: AttentionBatch) -> torch.Tensor:
    """The torch reference in fp32 on the same (dequantized) values."""
    return reference(
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        batch.page_table,
        batch.seq_lens,
        batch.extend_lens,
        batch.positions,
        PAGE,
        SCALE,
        batch.block_ids,
    )


def check(
    batch: AttentionBatch, config: AttentionConfig | None = None, decode_rows: int = 0
) -> None:
    tol = TOL[batch.q.dtype]
    got = run(batch, config, decode_rows).float()
    torch.testing.assert_close(got, expected(batch), rtol=tol, atol=tol)


DECODE = AttentionConfig(path="decode")
PREFILL = AttentionConfig(path="prefill")
SMALL_TILES = AttentionConfig(path="prefill", prefill_block_m=16)  # 8 tokens × 2 heads per tile
BOTH_PATHS = pytest.mark.parametrize("config", [DECODE, PREFILL], ids=["decode", "prefill"])
SPARSE = pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])


# --------------------------------------------------------------------------------- tests


@SPARSE
@BOTH_PATHS
def test_decode_tokens(sparse: bool, config: AttentionConfig) -> None:
    # The first token of a request, a token mid-page and one starting a fresh page.
    check(make_batch([(1, 1), (14, 1), (37, 1)], sparse=sparse, seed=1), config)


@SPARSE
def test_verify_blocks_bf16(sparse: bool) -> None:
    batch = make_batch([(17, 8), (26, 8)], sparse=sparse, q_dtype=torch.bfloat16, seed=2)
    check(batch)  # max_extend 8: the split-K decode path


@SPARSE
@BOTH_PATHS
def test_mixed_batch_with_chunks_starting_mid_page(sparse: bool, config: AttentionConfig) -> None:
    # A chunk from position 14 (mid-page), a decode token and a verify block.
    batch = make_batch([(23, 9), (30, 1), (19, 5)], sparse=sparse, seed=3)
    check(batch, config)


@SPARSE
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_chunk_spans_several_tiles(sparse: bool, q_dtype: torch.dtype) -> None:
    # A whole 30-token prompt: four 8-token tiles, the last one partial, and a decode request
    # whose single tile comes after them in the batch.
    batch = make_batch([(30, 30), (9, 1)], sparse=sparse, q_dtype=q_dtype, seed=4)
    check(batch, SMALL_TILES)


def test_auto_path_prefill_for_long_extend() -> None:
    batch = make_batch([(40, 17), (5, 2)], sparse=True, q_dtype=torch.bfloat16, seed=5)
    check(batch)  # max_extend 17 > 16: the prefill path


@SPARSE
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_in_front_of_a_prompt_take_the_decode_kernel(
    sparse: bool, q_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three decode rows (one at a fresh page), a 20-token chunk (past the decode path's 16)
    # starting mid-page, and a decode row behind it, which stays with the prefill tiles.
    batch = make_batch(
        [(9, 1), (13, 1), (30, 1), (40, 20), (6, 1)], sparse=sparse, q_dtype=q_dtype, seed=12
    )
    decoded: list[int] = []
    launch = attention_module.launch_decode

    def spy(q: torch.Tensor, *args: object) -> None:
        decoded.append(q.shape[0])
        launch(q, *args)

    monkeypatch.setattr(attention_module, "launch_decode", spy)
    check(batch, AttentionConfig(mixed_decode_min_rows=2), decode_rows=3)
    assert decoded == [3]
    check(batch, AttentionConfig(mixed_decode_min_rows=4), decode_rows=3)  # too few: one kernel
    check(batch, AttentionConfig(mixed_decode_min_rows=0), decode_rows=3)  # off
    assert decoded == [3]


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_split_counts_merge_to_the_same_result(splits: int) -> None:
    # 1 writes the output directly; 3 does not divide the work; 8 leaves some splits empty.
    batch = make_batch([(25, 2), (9, 1)], sparse=True, seed=6)
    check(batch, AttentionConfig(path="decode", num_splits=splits))
    dense = make_batch([(25, 2), (9, 1)], sparse=False, seed=6)
    check(dense, AttentionConfig(path="decode", num_splits=splits))


@BOTH_PATHS
def test_fp8_kv_cache(config: AttentionConfig) -> None:
    try:
        batch = make_batch(
            [(26, 6), (13, 1)], sparse=True, q_dtype=torch.bfloat16,
            kv_dtype=torch.float8_e4m3fn, seed=7,
        )  # fmt: skip
    except (RuntimeError, TypeError) as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"float8_e4m3fn tensors unavailable here: {exc}")
    # The reference sees the same fp8 values cast to fp32, so only compute error remains.
    check(batch, config)


@BOTH_PATHS
def test_one_index_head_shared_by_all_kv_heads(config: AttentionConfig) -> None:
    batch = make_batch([(22, 5), (17, 1)], sparse=True, num_idx_heads=1, seed=8)
    check(batch, config)


@BOTH_PATHS
def test_empty_selection_gives_zeros(config: AttentionConfig) -> None:
    # Cannot happen in practice (the local page is always selected), but must not give NaN.
    batch = make_batch([(18, 3), (10, 1)], sparse=True, seed=9)
    assert batch.block_ids is not None
    batch.block_ids[1] = -1  # token 1, every index head
    got = run(batch, config)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    keep = [0, 2, 3]
    want = expected(batch)[keep]  # the reference gives NaN for the empty row
    torch.testing.assert_close(got[keep], want, rtol=1e-3, atol=1e-3)


def test_strided_output_and_query() -> None:
    batch = make_batch([(15, 3)], sparse=True, seed=10)
    wide = torch.randn(3, NUM_KV * GROUP, 2 * HEAD_DIM, device=DEVICE)
    wide[..., :HEAD_DIM] = batch.q
    batch.q = wide[..., :HEAD_DIM]  # rows are 2·D apart: strides are honoured, not assumed
    check(batch)


def test_rejects_index_heads_finer_than_kv_heads() -> None:
    batch = make_batch([(9, 1)], sparse=True, num_idx_heads=4, seed=11)
    with pytest.raises(ValueError, match="index heads"):
        run(batch)
