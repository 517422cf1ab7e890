"""MSA lightning indexer: per-query block selection (torch reference).

Every index head scores every visible key with a plain dot product (fp32, no scale), the scores
are max-pooled over absolute blocks of `block_size` keys, the local (and init) blocks are forced
in, and the top-k blocks are kept. The output contract is the one sparse kernels consume:
block ids [T, H_idx, topk], valid ids first, no duplicates, -1 padding.
"""

from __future__ import annotations

import torch

from m3serve.kernels.paged import row_tiles, sequence_slots


def block_scores(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """q: [n, H, D] index queries, keys: [S, D] index keys of one sequence, positions: [n].

    Returns max-pooled block scores [H, n, ceil(S / block_size)], -inf where a block holds no
    key visible to the query.
    """
    seq_len = keys.shape[0]
    num_blocks = -(-seq_len // block_size)
    scores = torch.einsum("nhd,sd->hns", q.float(), keys.float())
    future = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    pad = num_blocks * block_size - seq_len
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(*scores.shape[:2], num_blocks, block_size).amax(dim=-1)


def select_blocks(
    scores: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
) -> torch.Tensor:
    """scores: [H, n, B] block scores -> block ids [n, H, topk] (int32, -1 padded)."""
    heads, _, num_blocks = scores.shape
    scores = scores.clone()
    q_block = positions // block_size
    offsets = torch.arange(local_blocks, device=scores.device)
    local = (q_block[:, None] - offsets[None, :]).clamp(min=0)
    scores.scatter_(-1, local[None].expand(heads, -1, -1), float("inf"))
    if init_blocks:
        init = torch.arange(min(init_blocks, num_blocks), device=scores.device)
        visible = init[None, :] <= q_block[:, None]
        boost = torch.where(visible, float("inf"), float("-inf"))
        scores[..., : init.numel()] = torch.maximum(scores[..., : init.numel()], boost[None])
    k = min(topk, num_blocks)
    top_scores, top_ids = scores.topk(k, dim=-1)
    ids = top_ids.masked_fill(top_scores == float("-inf"), -1).to(torch.int32)
    if k < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - k), value=-1)
    return ids.permute(1, 0, 2).contiguous()


def paged_index_topk(
    q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    positions: torch.Tensor,
    page_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Block selection for a batch: q [T, H_idx, D] -> block ids [T, H_idx, topk].

    Blocks are pages (block_size == page_size), so a block id is a logical page index. Rows
    are scored a tile at a time (`row_tiles`), so memory stays bounded for long prompts.
    """
    out = torch.empty(q.shape[0], q.shape[1], topk, dtype=torch.int32, device=q.device)
    start = 0
    for row, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        rows = slice(start, start + ext)
        start += ext
        keys = index_k_cache[sequence_slots(page_table[row], seq_len, page_size)]
        for tile in row_tiles(ext, q.shape[1], seq_len):
            tile = slice(rows.start + tile.start, rows.start + tile.stop)
            scores = block_scores(q[tile], keys, positions[tile], page_size)
            out[tile] = select_blocks(
                scores, positions[tile], page_size, topk, local_blocks, init_blocks
            )
    return out
