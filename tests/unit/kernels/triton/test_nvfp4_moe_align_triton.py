"""The sorted route's metadata (m3serve.kernels.triton.nvfp4_moe.align) against the grouping it
promises: experts in id order, each one's pairs in pair order, padded to whole blocks. Runs in
Triton's interpreter on the CPU (tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from helpers.devices import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.kernels.triton.nvfp4_moe import align


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_pairs(block_m: int) -> None:
    gen = torch.Generator().manual_seed(30)
    ids = torch.randint(0, 6, (45,), generator=gen)
    ids[ids == 4] = 5  # expert 4 empty
    sorted_pairs, block_expert, blocks = align.align_pairs(ids.to(DEVICE), 6, block_m)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    assert sorted_pairs.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    valid = sorted_pairs[sorted_pairs >= 0]
    assert sorted(valid.tolist()) == list(range(45)), "every pair exactly once"
    owner = block_expert.repeat_interleave(block_m)
    assert torch.equal(ids[sorted_pairs[sorted_pairs >= 0].long()], owner[sorted_pairs >= 0])
    for e in range(6):
        count = int((ids == e).sum())
        assert int((block_expert == e).sum()) == -(-count // block_m)
    used = block_expert >= 0
    assert not used[used.long().argmin() :].any() or used.all(), "unused blocks come last"
    # Within an expert the pairs keep ascending order (stable), so results are reproducible.
    for e in range(6):
        mine = sorted_pairs[(owner == e) & (sorted_pairs >= 0)]
        assert torch.equal(mine, mine.sort().values)


def _aligned_reference(
    ids: list[int], num_experts: int, block_m: int, tail_m: int, blocks: int
) -> tuple:
    """The layout align_pairs promises, built by hand: experts in id order, each one's pairs in
    pair order, block_m to a block and up to tail_m more in its last block (at least one block
    for an expert with pairs), each block -1 padded to block_m + tail_m; -1 to the end; each
    block's expert."""
    stride = block_m + tail_m
    sorted_pairs: list[int] = []
    block_expert: list[int] = []
    for e in range(num_experts):
        mine = [p for p, i in enumerate(ids) if i == e]
        if not mine:
            continue
        n = max(-(-(len(mine) - tail_m) // block_m), 1)
        for b in range(n):
            part = mine[b * block_m : (b + 1) * block_m] if b < n - 1 else mine[b * block_m :]
            sorted_pairs += part + [-1] * (stride - len(part))
        block_expert += [e] * n
    sorted_pairs += [-1] * (blocks * stride - len(sorted_pairs))
    block_expert += [-1] * (blocks - len(block_expert))
    return sorted_pairs, block_expert


@settings(max_examples=30, deadline=None)
@given(
    num_experts=st.integers(1, 9),
    block_m=st.sampled_from([16, 32, 64, 128]),
    tail_m=st.sampled_from([0, 16, 32]),
    data=st.data(),
)
def test_align_pairs_matches_the_stable_grouping(
    num_experts: int, block_m: int, tail_m: int, data
) -> None:
    # Up to ~5 chunks of the placing kernels; id num_experts is an expert held elsewhere.
    ids = data.draw(st.lists(st.integers(0, num_experts), min_size=1, max_size=600))
    sorted_pairs, block_expert, blocks = align.align_pairs(
        torch.tensor(ids, dtype=torch.int32, device=DEVICE), num_experts, block_m, tail_m
    )
    want_pairs, want_experts = _aligned_reference(ids, num_experts, block_m, tail_m, blocks)
    assert sorted_pairs.cpu().tolist() == want_pairs
    assert block_expert.cpu().tolist() == want_experts


def test_only_an_experts_last_block_fills_its_tail() -> None:
    """Blocks of 16 and a tail of 16: 20 pairs take one block and 4 of its tail, 40 a block
    of 16 with an empty tail then one of 24, 32 one block with a full tail, 33 two blocks."""
    counts = [20, 40, 32, 33]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).int()
    sorted_pairs, block_expert, blocks = align.align_pairs(ids.to(DEVICE), 4, 16, 16)
    filled = (sorted_pairs.cpu().view(blocks, 32) >= 0).sum(1)
    assert block_expert.cpu().tolist()[:6] == [0, 1, 1, 2, 3, 3]
    assert filled.tolist()[:6] == [20, 16, 24, 32, 16, 17]
    tails = (sorted_pairs.cpu().view(blocks, 32)[:, 16:] >= 0).any(1)
    assert tails.tolist()[:6] == [True, False, True, True, False, True]


def test_align_pairs_leaves_out_experts_held_elsewhere() -> None:
    ids = torch.tensor([3, 0, 3, 2, 1, 3, 0, 3])  # id 3: held by another rank (E = 3 here)
    sorted_pairs, block_expert, _ = align.align_pairs(ids.to(DEVICE), 3, 16)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    assert sorted(sorted_pairs[sorted_pairs >= 0].tolist()) == [1, 3, 4, 6]
    assert block_expert[block_expert >= 0].tolist() == [0, 1, 2]
