"""Paged dense / block-sparse attention (m3serve.kernels.attention) against naive loops."""

from __future__ import annotations

import math

import pytest
import torch

from m3serve.kernels.attention import block_mask, causal_mask, paged_attention

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


# ------------------------------------------------------------------------------- helpers


def paged_kv(
    seqs_k: list[torch.Tensor],
    seqs_v: list[torch.Tensor],
    page_size: int,
    shuffle: bool,
    total_pages: int = 32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches [slots, Hkv, D] holding each sequence at its pages, and the page table."""
    order = list(range(total_pages))
    if shuffle:
        order = torch.randperm(total_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    shape = (total_pages * page_size, *seqs_k[0].shape[1:])
    # NaN in every slot no request owns: reading one would poison the output.
    k_cache = torch.full(shape, float("nan"), dtype=seqs_k[0].dtype)
    v_cache = torch.full(shape, float("nan"), dtype=seqs_k[0].dtype)
    max_pages = max(-(-k.shape[0] // page_size) for k in seqs_k)
    table = torch.zeros(len(seqs_k), max_pages, dtype=torch.int32)
    cursor = 0
    for row, (k, v) in enumerate(zip(seqs_k, seqs_v, strict=True)):
        n = -(-k.shape[0] // page_size)
        pages = order[cursor : cursor + n]
        cursor += n
        table[row, :n] = torch.tensor(pages, dtype=torch.int32)
        for pos in range(k.shape[0]):
            slot = pages[pos // page_size] * page_size + pos % page_size
            k_cache[slot] = k[pos]
            v_cache[slot] = v[pos]
    return k_cache, v_cache, table


def random_batch(
    seq_lens: list[int], extend_lens: list[int], num_heads: int, num_kv: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(s, num_kv, HEAD_DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv, HEAD_DIM, generator=gen) for s in seq_lens]
    q = torch.randn(sum(extend_lens), num_heads, HEAD_DIM, generator=gen)
    positions = torch.cat(
        [torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens, strict=True)]
    )
    return q, ks, vs, positions


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: list[int],
    allowed_blocks: list[list[set[int]]] | None,
    block_size: int,
) -> torch.Tensor:
    """softmax(q.k * scale) v per (query, head) in float64; allowed_blocks[t][index_head]."""
    n, num_heads, _ = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    out = torch.zeros(n, num_heads, HEAD_DIM, dtype=torch.float64)
    for t in range(n):
        for h in range(num_heads):
            kv = h // group
            keys = range(positions[t] + 1)
            if allowed_blocks is not None:
                heads_per_index = num_heads // len(allowed_blocks[t])
                chosen = allowed_blocks[t][h // heads_per_index]
                keys = [s for s in keys if s // block_size in chosen]
            logits = torch.stack([(q[t, h].double() @ k[s, kv].double()) * SCALE for s in keys])
            probs = torch.softmax(logits, dim=0)
            out[t, h] = sum(p * v[s, kv].double() for p, s in zip(probs, keys, strict=True))
    return out


def all_causal_block_ids(positions: torch.Tensor, heads: int, block_size: int) -> torch.Tensor:
    topk = int(positions.max()) // block_size + 1
    ids = torch.full((positions.shape[0], heads, topk), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):
        # Reverse order on purpose: the selection is a set, its order must not matter.
        blocks = list(range(pos // block_size, -1, -1))
        ids[t, :, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return ids


def random_sparse_ids(
    positions: torch.Tensor, heads: int, block_size: int, topk: int, seed: int
) -> tuple[torch.Tensor, list[list[set[int]]]]:
    """A valid selection (local block + random causal blocks, -1 padded) and its sets."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((positions.shape[0], heads, topk), -1, dtype=torch.int32)
    sets: list[list[set[int]]] = []
    for t, pos in enumerate(positions.tolist()):
        q_block = pos // block_size
        row = []
        for h in range(heads):
            others = torch.randperm(q_block, generator=gen)[: topk - 1].tolist()
            chosen = [q_block, *others]
            ids[t, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
            row.append(set(chosen))
        sets.append(row)
    return ids, sets


# --------------------------------------------------------------------------------- tests


def test_shuffled_pages_give_identical_output_to_contiguous_pages() -> None:
    seq_lens, ext = [23, 11], [23, 4]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=0)
    ids, _ = random_sparse_ids(positions, 2, 4, 3, seed=1)
    k_c, v_c, t_c = paged_kv(ks, vs, 4, shuffle=False)
    k_s, v_s, t_s = paged_kv(ks, vs, 4, shuffle=True, seed=2)
    assert not torch.equal(t_c, t_s)
    for block_ids in (None, ids):
        contiguous = paged_attention(
            q, k_c, v_c, t_c, seq_lens, ext, positions, 4, SCALE, block_ids
        )
        shuffled = paged_attention(q, k_s, v_s, t_s, seq_lens, ext, positions, 4, SCALE, block_ids)
        assert torch.equal(contiguous, shuffled)
        assert not contiguous.isnan().any()


def test_selecting_every_causal_block_equals_dense_causal_attention() -> None:
    seq_lens, ext = [21], [21]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=3)
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=True, seed=4)
    ids = all_causal_block_ids(positions, 2, 4)
    sparse = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE, ids)
    dense = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE, None)
    naive = naive_attention(q, ks[0], vs[0], positions.tolist(), None, 4)
    assert torch.equal(sparse, dense)
    torch.testing.assert_close(dense.double(), naive, rtol=1e-5, atol=1e-6)


def test_sparse_selection_equals_naive_masked_attention() -> None:
    seq_lens, ext = [30], [30]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=5)
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=True, seed=6)
    ids, sets = random_sparse_ids(positions, 2, 4, 3, seed=7)
    got = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE, ids)
    expected = naive_attention(q, ks[0], vs[0], positions.tolist(), sets, 4)
    dense = naive_attention(q, ks[0], vs[0], positions.tolist(), None, 4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # The selection actually drops keys for the late queries, so the result is not dense.
    assert not torch.allclose(got[-1].double(), dense[-1], atol=1e-3)


def test_query_head_uses_kv_head_of_its_group() -> None:
    # Each KV head's values are the constant kv + 1, so head h must output h // group + 1.
    num_heads, num_kv, seq_len = 6, 3, 9
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(seq_len, num_kv, HEAD_DIM, generator=gen)
    v = torch.arange(1, num_kv + 1, dtype=torch.float32)[None, :, None].expand(
        seq_len, num_kv, HEAD_DIM
    )
    q = torch.randn(seq_len, num_heads, HEAD_DIM, generator=gen)
    k_cache, v_cache, table = paged_kv([k], [v.clone()], 4, shuffle=True)
    out = paged_attention(
        q, k_cache, v_cache, table, [seq_len], [seq_len], torch.arange(seq_len), 4, SCALE
    )
    group = num_heads // num_kv
    for h in range(num_heads):
        torch.testing.assert_close(out[:, h], torch.full((seq_len, HEAD_DIM), h // group + 1.0))


def test_query_head_uses_selection_of_its_index_head() -> None:
    # Equal keys -> uniform attention over the allowed keys; v[s] = s gives their mean position.
    num_heads, num_kv, seq_len, bs = 4, 2, 16, 4
    k = torch.zeros(seq_len, num_kv, HEAD_DIM)
    v = torch.arange(seq_len, dtype=torch.float32)[:, None, None].expand(seq_len, num_kv, HEAD_DIM)
    q = torch.randn(1, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    k_cache, v_cache, table = paged_kv([k], [v.clone()], bs, shuffle=True, seed=1)
    ids = torch.tensor([[[3, 0], [3, 2]]], dtype=torch.int32)  # index head 0: {0,3}, 1: {2,3}
    positions = torch.tensor([14])
    out = paged_attention(q, k_cache, v_cache, table, [seq_len], [1], positions, bs, SCALE, ids)
    mean_head0 = sum([0, 1, 2, 3, 12, 13, 14]) / 7  # key 15 is the query's future
    mean_head1 = sum([8, 9, 10, 11, 12, 13, 14]) / 7
    expected = [mean_head0, mean_head0, mean_head1, mean_head1]
    for h in range(num_heads):
        torch.testing.assert_close(out[0, h], torch.full((HEAD_DIM,), expected[h]))


def test_index_heads_fewer_than_kv_heads_cover_consecutive_query_heads() -> None:
    seq_lens, ext = [20], [6]
    q, ks, vs, positions = random_batch(seq_lens, ext, 8, 4, seed=10)
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=True, seed=11)
    ids, sets = random_sparse_ids(positions, 2, 4, 2, seed=12)  # 2 index heads, 4 kv heads
    got = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE, ids)
    expected = naive_attention(q, ks[0], vs[0], positions.tolist(), sets, 4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_multi_request_batch_equals_per_request_calls(sparse: bool) -> None:
    seq_lens, ext = [26, 5, 13, 9], [3, 5, 1, 8]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=13)
    ids = random_sparse_ids(positions, 2, 4, 3, seed=14)[0] if sparse else None
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=True, seed=15)
    batched = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE, ids)
    start = 0
    for row, (seq_len, n) in enumerate(zip(seq_lens, ext, strict=True)):
        rows = slice(start, start + n)
        start += n
        alone = paged_attention(
            q[rows],
            k_cache,
            v_cache,
            table[row : row + 1],
            [seq_len],
            [n],
            positions[rows],
            4,
            SCALE,
            None if ids is None else ids[rows],
        )
        assert torch.equal(batched[rows], alone)
        sets = (
            None if ids is None else [[{int(b) for b in h if b >= 0} for h in t] for t in ids[rows]]
        )
        naive = naive_attention(q[rows], ks[row], vs[row], positions[rows].tolist(), sets, 4)
        torch.testing.assert_close(batched[rows].double(), naive, rtol=1e-5, atol=1e-6)


def test_decode_query_attends_to_the_whole_history() -> None:
    seq_lens, ext = [45], [1]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=16)
    k_cache, v_cache, table = paged_kv(ks, vs, 8, shuffle=True, seed=17)
    out = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 8, SCALE)
    naive = naive_attention(q, ks[0], vs[0], [44], None, 8)
    torch.testing.assert_close(out.double(), naive, rtol=1e-5, atol=1e-6)


def test_scale_is_applied_to_the_scores() -> None:
    seq_lens, ext = [7], [7]
    q, ks, vs, positions = random_batch(seq_lens, ext, 2, 1, seed=18)
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=False)
    scaled = paged_attention(q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE)
    doubled = paged_attention(2 * q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE)
    halved_scale = paged_attention(
        2 * q, k_cache, v_cache, table, seq_lens, ext, positions, 4, SCALE / 2
    )
    torch.testing.assert_close(scaled, halved_scale)
    assert not torch.allclose(scaled, doubled)


def test_bf16_inputs_keep_dtype_and_track_fp32() -> None:
    seq_lens, ext = [19], [19]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=19)
    k32, v32, table = paged_kv(ks, vs, 4, shuffle=True)
    ref = paged_attention(q, k32, v32, table, seq_lens, ext, positions, 4, SCALE)
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    out = paged_attention(q.bfloat16(), k16, v16, table, seq_lens, ext, positions, 4, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------------------- block_mask


def test_block_mask_combines_selection_and_causality() -> None:
    # seq 10, block 4 -> blocks {0: 0-3, 1: 4-7, 2: 8-9}. Query at 5 picks blocks {1, 0}; query at
    # 9 picks {2} then padding. Head 1 picks differently.
    ids = torch.tensor([[[1, 0, -1], [1, -1, -1]], [[2, -1, -1], [2, 0, 1]]], dtype=torch.int32)
    mask = block_mask(ids, torch.tensor([5, 9]), seq_len=10, block_size=4)
    assert mask.shape == (2, 2, 10)
    assert mask.dtype == torch.bool
    rows = {
        (0, 0): [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
        (0, 1): [0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
        (1, 0): [0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        (1, 1): [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    }
    for (head, t), expected in rows.items():
        assert mask[head, t].int().tolist() == expected, (head, t)


def test_block_mask_ignores_minus_one_padding() -> None:
    padded = torch.tensor([[[0, -1, -1, -1]]], dtype=torch.int32)
    mask = block_mask(padded, torch.tensor([11]), seq_len=12, block_size=4)
    assert mask[0, 0].int().tolist() == [1] * 4 + [0] * 8


def test_block_mask_with_every_causal_block_is_the_causal_mask() -> None:
    positions = torch.arange(3, 18)
    ids = all_causal_block_ids(positions, 3, 4)
    mask = block_mask(ids, positions, seq_len=18, block_size=4)
    assert torch.equal(mask, causal_mask(positions, 18)[None].expand(3, -1, -1))


def test_block_mask_matches_hf_build_block_mask() -> None:
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    cfg = MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=3,
        layer_types=["minimax_m3_sparse"],
        mlp_layer_types=["dense"],
        bos_token_id=1,
        eos_token_id=2,
    )
    indexer = MiniMaxM3VLIndexer(cfg, layer_idx=0)
    positions = torch.arange(22)
    ids, _ = random_sparse_ids(positions, 2, 4, 3, seed=20)
    hf = indexer.build_block_mask(
        ids.permute(1, 0, 2)[None].long(), None, 22, torch.float32, "cpu", positions[None]
    )  # [1, num_heads, T, S], 0 = allowed
    ours = block_mask(ids, positions, seq_len=22, block_size=4)  # [index heads, T, S]
    assert torch.equal(ours.repeat_interleave(2, dim=0), hf[0] == 0)


def test_causal_mask_allows_keys_up_to_and_including_the_position() -> None:
    mask = causal_mask(torch.tensor([0, 2]), 4)
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]


def test_naive_reference_is_plain_softmax_attention() -> None:
    # Guard the oracle itself on a hand-computable case: two keys, logits 0 and log 3.
    q = torch.zeros(1, 1, HEAD_DIM)
    q[0, 0, 0] = math.log(3.0) / SCALE
    k = torch.zeros(2, 1, HEAD_DIM)
    k[1, 0, 0] = 1.0
    v = torch.zeros(2, 1, HEAD_DIM)
    v[0, 0, 0], v[1, 0, 0] = 4.0, 8.0
    out = naive_attention(q, k, v, [1], None, 4)
    assert out[0, 0, 0].item() == pytest.approx(0.25 * 4.0 + 0.75 * 8.0)


def test_a_long_request_is_scored_in_bounded_tiles_with_the_same_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A prefill chunk must not hold chunk x prompt scores at once: with a tiny tile budget the
    # rows are scored a few at a time, and the output is the one of scoring them all together.
    import m3serve.kernels.attention as attention_module
    import m3serve.kernels.paged as paged

    seq_lens, ext = [40, 13], [40, 6]
    q, ks, vs, positions = random_batch(seq_lens, ext, 4, 2, seed=8)
    k_cache, v_cache, table = paged_kv(ks, vs, 4, shuffle=True, seed=9)
    ids, _ = random_sparse_ids(positions, 2, 4, 3, seed=10)
    selections = (None, ids)
    batch = (table, seq_lens, ext, positions, 4, SCALE)
    whole = [paged_attention(q, k_cache, v_cache, *batch, b) for b in selections]
    budget = 4 * 40 * 3  # three rows of the long request per tile
    monkeypatch.setattr(paged, "SCORE_TILE_ELEMENTS", budget)
    scored: list[int] = []
    real = attention_module.attention

    def counting(q_rows: torch.Tensor, k: torch.Tensor, *args: object) -> torch.Tensor:
        scored.append(q_rows.shape[0] * q_rows.shape[1] * k.shape[0])
        return real(q_rows, k, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_module, "attention", counting)
    for block_ids, expected in zip(selections, whole, strict=True):
        tiled = paged_attention(q, k_cache, v_cache, *batch, block_ids)
        torch.testing.assert_close(tiled, expected, rtol=1e-6, atol=1e-6)
    assert max(scored) <= budget
    assert len(scored) > 2 * len(seq_lens)  # the rows really were split
