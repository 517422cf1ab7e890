"""Block selection of the MSA lightning indexer (m3serve.kernels.indexer).

Crafted inputs plant a known winner per block (every key is the query direction times a chosen
score), so the expected selection is written by hand. Random inputs are checked against HF's
`MiniMaxM3VLIndexer` and against structural properties (hypothesis).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.kernels.indexer import block_scores, paged_index_topk, select_blocks
from m3serve.kernels.norm import gemma_rms_norm
from m3serve.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

DIM = 8
NEG_INF = float("-inf")


def planted_keys(per_key_scores: list[float], dim: int = DIM) -> torch.Tensor:
    """Keys [S, dim] whose dot product with the unit query e0 is the given score."""
    keys = torch.zeros(len(per_key_scores), dim)
    keys[:, 0] = torch.tensor(per_key_scores)
    return keys


def unit_query(n: int, heads: int = 1, axis: int = 0, dim: int = DIM) -> torch.Tensor:
    q = torch.zeros(n, heads, dim)
    q[..., axis] = 1.0
    return q


def select(
    q: torch.Tensor,
    keys: torch.Tensor,
    positions: list[int] | torch.Tensor,
    block_size: int,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    positions = torch.as_tensor(positions)
    scores = block_scores(q, keys, positions, block_size)
    return select_blocks(scores, positions, block_size, topk, local_blocks, init_blocks)


def valid_set(ids: torch.Tensor) -> set[int]:
    return {int(i) for i in ids if i >= 0}


def block_values(per_block: list[float], block_size: int, filler: float = -1.0) -> list[float]:
    """Per-key scores: one key per block carries the block's planted value, the rest `filler`."""
    out = []
    for value in per_block:
        out += [value] + [filler] * (block_size - 1)
    return out


# ----------------------------------------------------------------- crafted selections


def test_top_scoring_blocks_win_alongside_local_block() -> None:
    # 8 blocks of 4; the query sits in block 7. Planted maxima: block 1 > block 4 > block 2.
    per_block = [0.0, 10.0, 3.0, 0.0, 5.0, 0.0, 0.0, -50.0]
    keys = planted_keys(block_values(per_block, 4))
    ids = select(unit_query(1), keys, [31], block_size=4, topk=3)
    assert ids.shape == (1, 1, 3)
    assert ids.dtype == torch.int32
    assert ids[0, 0].tolist() == [7, 1, 4]


def test_local_block_always_selected_even_with_lowest_score() -> None:
    per_block = [9.0, 8.0, 7.0, 6.0, 5.0, -100.0]
    keys = planted_keys(block_values(per_block, 4, filler=-100.0))
    ids = select(unit_query(1), keys, [22], block_size=4, topk=2)
    assert valid_set(ids[0, 0]) == {5, 0}


def test_local_blocks_two_forces_the_block_before_the_query_block() -> None:
    per_block = [9.0, 8.0, 7.0, -100.0, -100.0, -100.0]
    keys = planted_keys(block_values(per_block, 4, filler=-100.0))
    ids = select(unit_query(1), keys, [23], block_size=4, topk=3, local_blocks=2)
    assert valid_set(ids[0, 0]) == {5, 4, 0}


def test_local_blocks_beyond_block_zero_do_not_duplicate_block_zero() -> None:
    keys = planted_keys(block_values([1.0, 2.0, 3.0], 4))
    # Query in block 0 with 3 forced local blocks: only block 0 exists causally.
    ids = select(unit_query(1), keys, [2], block_size=4, topk=3, local_blocks=3)
    assert ids[0, 0].tolist() == [0, -1, -1]


def test_no_duplicates_when_local_block_also_scores_highest() -> None:
    per_block = [1.0, 2.0, 3.0, 100.0]
    keys = planted_keys(block_values(per_block, 4))
    ids = select(unit_query(1), keys, [15], block_size=4, topk=3)
    assert ids[0, 0].tolist()[0] == 3
    assert sorted(ids[0, 0].tolist()) == [1, 2, 3]


def test_minus_one_padding_when_fewer_blocks_than_topk() -> None:
    keys = planted_keys([float(s) for s in range(10)])  # 3 blocks of 4, last one partial
    ids = select(unit_query(1), keys, [9], block_size=4, topk=5)
    assert ids.shape == (1, 1, 5)
    assert sorted(ids[0, 0, :3].tolist()) == [0, 1, 2]
    assert ids[0, 0, 3:].tolist() == [-1, -1]


def test_queries_early_in_the_sequence_pad_with_minus_one() -> None:
    keys = planted_keys([float(s) for s in range(16)])  # 4 blocks
    ids = select(unit_query(4), keys, [0, 5, 9, 15], block_size=4, topk=3)
    assert ids[0, 0].tolist() == [0, -1, -1]
    assert sorted(ids[1, 0, :2].tolist()) == [0, 1] and ids[1, 0, 2] == -1
    assert sorted(ids[2, 0].tolist()) == [0, 1, 2]
    assert valid_set(ids[3, 0]) == {3, 2, 1}


def test_future_blocks_never_selected_despite_huge_scores() -> None:
    # Blocks after each query's block carry enormous scores; they must never appear.
    per_block = [1.0, 0.0, 0.0, 1e6, 1e6, 1e6]
    keys = planted_keys(block_values(per_block, 4))
    positions = [1, 6, 10]
    ids = select(unit_query(3), keys, positions, block_size=4, topk=4)
    for row, pos in enumerate(positions):
        chosen = valid_set(ids[row, 0])
        assert chosen == set(range(pos // 4 + 1))
        assert all(b <= pos // 4 for b in chosen)


def test_key_after_query_inside_its_block_does_not_raise_block_max() -> None:
    # Query at position 5 sits in block 1 (keys 4..7); keys 6 and 7 are its future.
    per_key = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1000.0, 2000.0]
    scores = block_scores(unit_query(1), planted_keys(per_key), torch.tensor([5]), 4)
    assert scores.shape == (1, 1, 2)
    assert scores[0, 0].tolist() == [3.0, 5.0]


def test_future_spike_never_leaks_into_earlier_queries_block_scores() -> None:
    # A spike at the last key must not reach any earlier query; fully-future blocks are -inf.
    per_key = [0.0] * 12
    per_key[11] = 1e9
    scores = block_scores(unit_query(3), planted_keys(per_key), torch.tensor([3, 7, 9]), 4)
    assert scores[0, 0].tolist() == [0.0, NEG_INF, NEG_INF]
    assert scores[0, 1].tolist() == [0.0, 0.0, NEG_INF]
    assert scores[0, 2].tolist() == [0.0, 0.0, 0.0]


def test_partial_last_block_is_padded_with_minus_inf_not_zero() -> None:
    # All visible scores negative: zero-padding would make the partial block's max 0.
    per_key = [-5.0] * 8 + [-3.0, -2.0]
    scores = block_scores(unit_query(1), planted_keys(per_key), torch.tensor([9]), 4)
    assert scores[0, 0].tolist() == [-5.0, -5.0, -2.0]


def test_scores_are_unscaled_fp32_dot_products() -> None:
    q = torch.tensor([[[1.5, -2.0, 0.5, 0.0]]], dtype=torch.bfloat16)
    keys = torch.tensor([[2.0, 1.0, 4.0, 7.0]], dtype=torch.bfloat16)
    scores = block_scores(q, keys, torch.tensor([0]), 1)
    assert scores.dtype == torch.float32
    assert scores.item() == 1.5 * 2.0 - 2.0 * 1.0 + 0.5 * 4.0


def test_each_index_head_selects_its_own_blocks() -> None:
    # Head 0 queries along e0, head 1 along e1; block 1 wins for e0, block 3 for e1.
    keys = torch.zeros(24, DIM)
    keys[4, 0] = 10.0
    keys[12, 1] = 10.0
    keys[16, 0] = 1.0
    keys[8, 1] = 1.0
    q = torch.zeros(1, 2, DIM)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = 1.0
    ids = select(q, keys, [23], block_size=4, topk=3)
    assert ids.shape == (1, 2, 3)
    assert ids[0, 0].tolist() == [5, 1, 4]
    assert ids[0, 1].tolist() == [5, 3, 2]


def test_init_blocks_forced_even_with_lowest_score() -> None:
    per_block = [-100.0, 5.0, 6.0, 7.0, 8.0, 0.0]
    keys = planted_keys(block_values(per_block, 4, filler=-100.0))
    without = select(unit_query(1), keys, [21], block_size=4, topk=3)
    with_init = select(unit_query(1), keys, [21], block_size=4, topk=3, init_blocks=1)
    assert valid_set(without[0, 0]) == {5, 4, 3}
    assert valid_set(with_init[0, 0]) == {5, 0, 4}


def test_init_blocks_in_the_future_are_not_forced() -> None:
    keys = planted_keys([0.0] * 16)
    ids = select(unit_query(2), keys, [1, 5], block_size=4, topk=4, init_blocks=3)
    # Query at position 1 sees block 0 only; query at 5 sees blocks 0 and 1.
    assert ids[0, 0].tolist() == [0, -1, -1, -1]
    assert sorted(ids[1, 0, :2].tolist()) == [0, 1]
    assert ids[1, 0, 2:].tolist() == [-1, -1]


def test_init_blocks_larger_than_sequence_are_clamped() -> None:
    keys = planted_keys([1.0] * 6)
    ids = select(unit_query(1), keys, [5], block_size=4, topk=4, init_blocks=3)
    assert sorted(ids[0, 0, :2].tolist()) == [0, 1]
    assert ids[0, 0, 2:].tolist() == [-1, -1]


def test_init_and_local_blocks_overlap_without_duplicates() -> None:
    keys = planted_keys(block_values([1.0, 2.0, 3.0, 4.0], 4))
    ids = select(unit_query(1), keys, [2], block_size=4, topk=3, init_blocks=1)
    assert ids[0, 0].tolist() == [0, -1, -1]


def test_selection_depends_only_on_keys_up_to_the_query_position() -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(40, DIM, generator=gen)
    q = torch.randn(5, 2, DIM, generator=gen)
    positions = [13, 19, 22, 30, 39]
    before = select(q, keys, positions, block_size=4, topk=3)
    for row, pos in enumerate(positions):
        perturbed = keys.clone()
        perturbed[pos + 1 :] = 1e4 * torch.randn(40 - pos - 1, DIM, generator=gen)
        after = select(q[row : row + 1], perturbed, positions[row : row + 1], 4, 3)
        assert torch.equal(after[0], before[row])


# ----------------------------------------------------------------------- paged selection


def write_pages(
    values: torch.Tensor, pages: list[int], page_size: int, cache: torch.Tensor
) -> None:
    """Store a sequence's rows [S, ...] into `cache` at its pages' physical slots."""
    for pos in range(values.shape[0]):
        cache[pages[pos // page_size] * page_size + pos % page_size] = values[pos]


def paged_setup(
    seqs: list[torch.Tensor], page_size: int, shuffle: bool, total_pages: int = 24, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index-key cache and page table [B, max_pages] for sequences of keys [S_b, D]."""
    order = list(range(total_pages))
    if shuffle:
        order = torch.randperm(total_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    max_pages = max(-(-s.shape[0] // page_size) for s in seqs)
    cache = torch.full((total_pages * page_size, seqs[0].shape[1]), float("nan"))
    table = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
    cursor = 0
    for row, keys in enumerate(seqs):
        n = -(-keys.shape[0] // page_size)
        pages = order[cursor : cursor + n]
        cursor += n
        table[row, :n] = torch.tensor(pages, dtype=torch.int32)
        write_pages(keys, pages, page_size, cache)
    return cache, table


def batch_inputs(
    seq_lens: list[int], extend_lens: list[int], heads: int, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(s, DIM, generator=gen) for s in seq_lens]
    q = torch.randn(sum(extend_lens), heads, DIM, generator=gen)
    positions = torch.cat(
        [torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens, strict=True)]
    )
    return keys, q, positions


@pytest.mark.parametrize("page_size", [4, 5])
def test_paged_selection_with_shuffled_pages_matches_contiguous(page_size: int) -> None:
    seq_lens, extend_lens = [37, 9, 22], [5, 9, 1]
    keys, q, positions = batch_inputs(seq_lens, extend_lens, heads=2, seed=1)
    args = (seq_lens, extend_lens, positions, page_size, 3, 1)
    cache_c, table_c = paged_setup(keys, page_size, shuffle=False)
    cache_s, table_s = paged_setup(keys, page_size, shuffle=True)
    contiguous = paged_index_topk(q, cache_c, table_c, *args)
    shuffled = paged_index_topk(q, cache_s, table_s, *args)
    assert not torch.equal(table_c, table_s)
    assert torch.equal(contiguous, shuffled)


def test_paged_selection_equals_per_request_selection() -> None:
    seq_lens, extend_lens = [37, 9, 22], [5, 9, 1]
    keys, q, positions = batch_inputs(seq_lens, extend_lens, heads=2, seed=2)
    cache, table = paged_setup(keys, 4, shuffle=True, seed=3)
    got = paged_index_topk(q, cache, table, seq_lens, extend_lens, positions, 4, 3, 1, 1)
    start = 0
    for keys_b, ext in zip(keys, extend_lens, strict=True):
        rows = slice(start, start + ext)
        start += ext
        expected = select(q[rows], keys_b, positions[rows], 4, 3, local_blocks=1, init_blocks=1)
        assert torch.equal(got[rows], expected)
    assert got.shape == (sum(extend_lens), 2, 3)
    assert got.dtype == torch.int32


def test_paged_selection_logical_block_ids_follow_planted_pages() -> None:
    # One planted winner in logical block 2; its physical page is deliberately different.
    keys = planted_keys(block_values([0.0, 0.0, 50.0, 0.0, 0.0, 0.0], 4))
    cache, table = paged_setup([keys], 4, shuffle=True, seed=5)
    assert int(table[0, 2]) != 2
    ids = paged_index_topk(unit_query(1), cache, table, [24], [1], torch.tensor([23]), 4, 2, 1)
    assert ids[0, 0].tolist() == [5, 2]


# ------------------------------------------------------------------- HF reference parity


def hf_indexer_setup(block_size: int, topk: int, local_blocks: int, seed: int) -> tuple:
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLIndexer,
        MiniMaxM3VLRotaryEmbedding,
    )

    cfg = MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=block_size,
        index_topk_blocks=topk,
        index_local_blocks=local_blocks,
        layer_types=["minimax_m3_sparse"],
        mlp_layer_types=["dense"],
        bos_token_id=1,
        eos_token_id=2,
    )
    indexer = MiniMaxM3VLIndexer(cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for proj in (indexer.q_proj, indexer.k_proj):
            proj.weight.normal_(0.0, cfg.hidden_size**-0.5, generator=gen)
        # Non-zero Gemma offsets, so the (1 + w) scaling is part of the comparison.
        for norm in (indexer.q_norm, indexer.k_norm):
            norm.weight.normal_(0.0, 0.5, generator=gen)
    return cfg, indexer, MiniMaxM3VLRotaryEmbedding(cfg)


def our_index_qk(
    indexer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, theta: float, rot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Projections + Gemma norm + partial RoPE with m3serve kernels: ([S, H, D], [S, D])."""
    heads, dim = indexer.num_heads, indexer.head_dim
    eps = indexer.q_norm.eps
    iq = (x @ indexer.q_proj.weight.t()).view(x.shape[0], heads, dim)
    ik = (x @ indexer.k_proj.weight.t()).view(x.shape[0], 1, dim)
    iq = gemma_rms_norm(iq, indexer.q_norm.weight, eps)
    ik = gemma_rms_norm(ik, indexer.k_norm.weight, eps)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(rot, theta))
    return apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, 0]


@pytest.mark.parametrize(
    ("block_size", "topk", "local_blocks", "seq_len"),
    [(4, 3, 1, 45), (4, 5, 2, 45), (8, 2, 1, 61), (3, 4, 1, 50)],
)
@torch.no_grad()
def test_selected_block_sets_match_hf_indexer(
    block_size: int, topk: int, local_blocks: int, seq_len: int
) -> None:
    cfg, indexer, rotary = hf_indexer_setup(block_size, topk, local_blocks, seed=seq_len)
    x = torch.randn(1, seq_len, cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    position_ids = torch.arange(seq_len)[None]
    cos, sin = rotary(x, position_ids)
    hf_ids = indexer(x, (cos, sin), None, position_ids)[0].permute(1, 0, 2)  # [S, H, k_eff]

    iq, ik = our_index_qk(indexer, x[0], position_ids[0], 5e6, 8)
    ours = select(iq, ik, position_ids[0], block_size, topk, local_blocks)

    assert ours.shape == (seq_len, 2, topk)
    dropped = 0
    for t in range(seq_len):
        for h in range(2):
            assert valid_set(ours[t, h]) == valid_set(hf_ids[t, h]), (t, h)
            dropped += t // block_size + 1 - len(valid_set(ours[t, h]))
    assert dropped > 0  # the comparison covers queries whose selection actually drops blocks


@torch.no_grad()
def test_chunked_paged_selection_matches_hf_full_prefill() -> None:
    # Prefill 29 tokens, then a 8-token verify chunk read back from shuffled pages: the chunk's
    # selections must equal the rows of HF's one-shot prefill over all 37 tokens.
    cfg, indexer, rotary = hf_indexer_setup(4, 3, 1, seed=3)
    seq_len, ext = 37, 8
    x = torch.randn(1, seq_len, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    position_ids = torch.arange(seq_len)[None]
    hf_ids = indexer(x, rotary(x, position_ids), None, position_ids)[0].permute(1, 0, 2)

    iq, ik = our_index_qk(indexer, x[0], position_ids[0], 5e6, 8)
    cache, table = paged_setup([ik], 4, shuffle=True, seed=9)
    chunk = paged_index_topk(
        iq[-ext:], cache, table, [seq_len], [ext], position_ids[0, -ext:], 4, 3, 1
    )
    for row in range(ext):
        for h in range(2):
            assert valid_set(chunk[row, h]) == valid_set(hf_ids[seq_len - ext + row, h])


# ---------------------------------------------------------------------------- properties


@st.composite
def selection_cases(draw: st.DrawFn) -> dict:
    block_size = draw(st.integers(1, 6))
    seq_len = draw(st.integers(1, 40))
    topk = draw(st.integers(1, 6))
    local_blocks = draw(st.integers(1, topk))
    init_blocks = draw(st.integers(0, topk - local_blocks))
    extend = draw(st.integers(1, seq_len))
    heads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return dict(
        block_size=block_size,
        seq_len=seq_len,
        topk=topk,
        local_blocks=local_blocks,
        init_blocks=init_blocks,
        extend=extend,
        heads=heads,
        seed=seed,
    )


@settings(max_examples=80, deadline=None)
@given(case=selection_cases())
def test_selection_is_a_valid_causal_topk_set_containing_forced_blocks(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    seq_len, bs, topk = case["seq_len"], case["block_size"], case["topk"]
    keys = torch.randn(seq_len, DIM, generator=gen)
    q = torch.randn(case["extend"], case["heads"], DIM, generator=gen)
    positions = torch.arange(seq_len - case["extend"], seq_len)
    scores = block_scores(q, keys, positions, bs)
    ids = select_blocks(scores, positions, bs, topk, case["local_blocks"], case["init_blocks"])

    assert ids.shape == (case["extend"], case["heads"], topk)
    for row, pos in enumerate(positions.tolist()):
        q_block = pos // bs
        forced = {max(q_block - i, 0) for i in range(case["local_blocks"])}
        forced |= set(range(min(case["init_blocks"], q_block + 1)))
        for h in range(case["heads"]):
            entries = ids[row, h].tolist()
            valid = [b for b in entries if b >= 0]
            assert entries == valid + [-1] * (topk - len(valid))  # -1 only at the end
            assert len(set(valid)) == len(valid)
            assert all(0 <= b <= q_block for b in valid)
            assert len(valid) == min(topk, q_block + 1)
            assert forced <= set(valid)
            # Unforced winners outscore every causal block left out.
            free = [b for b in valid if b not in forced]
            left_out = set(range(q_block + 1)) - set(valid)
            if free and left_out:
                worst_kept = min(float(scores[h, row, b]) for b in free)
                assert all(float(scores[h, row, b]) <= worst_kept for b in left_out)


def test_a_long_request_is_scored_in_bounded_tiles_with_the_same_selection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import m3serve.kernels.indexer as indexer
    import m3serve.kernels.paged as paged

    seq_lens, extend_lens = [37, 9], [30, 9]
    keys, q, positions = batch_inputs(seq_lens, extend_lens, heads=2, seed=4)
    cache, table = paged_setup(keys, 4, shuffle=True, seed=5)
    args = (seq_lens, extend_lens, positions, 4, 3, 1, 1)
    whole = paged_index_topk(q, cache, table, *args)
    budget = 2 * 37 * 4  # four rows of the long request per tile
    monkeypatch.setattr(paged, "SCORE_TILE_ELEMENTS", budget)
    scored: list[int] = []
    real = indexer.block_scores

    def counting(q_rows: torch.Tensor, k: torch.Tensor, *rest: object) -> torch.Tensor:
        scored.append(q_rows.shape[0] * q_rows.shape[1] * k.shape[0])
        return real(q_rows, k, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(indexer, "block_scores", counting)
    assert torch.equal(paged_index_topk(q, cache, table, *args), whole)
    assert max(scored) <= budget
    assert len(scored) > 2 * len(seq_lens)
