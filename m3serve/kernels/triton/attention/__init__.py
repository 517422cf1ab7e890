"""Paged attention over the KV cache, dense-causal or block-sparse, in Triton (Hopper backend).

Same math as `m3serve.kernels.attention.paged_attention` (the ground truth): for each new token
and query head, softmax(q·k·scale) over the keys that are (a) at or before the token's position,
(b) inside the request (key < seq_len) and (c) for sparse layers, in one of the logical pages the
token's index head selected. Scores, softmax and the accumulator are fp32; K/V are bf16 or
float8_e4m3fn (scale 1.0, dequantized on load) and the P·V product runs in q's dtype.

Two paths, picked from `max_extend` (a host int the batch already carries, so no sync):

* decode / verify (every request has ≤ 16 new tokens): split-K flash-decoding. The grid is
  (token, KV head, split) and one program handles the G query heads of its KV head as one
  [G, D] tile (so K/V are read once per GQA group and tl.dot can be used) over its share of the
  token's keys: a share of its K selected pages, or for dense layers a share of all pages up to
  its position. Partial O and log-sum-exp go to scratch buffers and a second small kernel merges
  the splits. The grid and split count depend on shapes only (no host sync, no data-dependent
  sizes), so the call is CUDA-graph capturable; how the keys divide between splits is computed
  in the kernel from the live positions.
* prefill (any extend length): varlen flash-attention. A tile is BLOCK_T consecutive new tokens
  of one request × the G query heads of one KV head (BLOCK_T·G rows, G fastest), so a K/V chunk
  is shared by the whole GQA group. Dense tiles walk every page up to the tile's last position
  with a per-row causal mask. Sparse tiles walk the union of their tokens' selected pages: a
  small planning kernel dedupes the tile's BLOCK_T·K selection entries into a compact page list
  once per (tile, index head), and each row is masked by its own token's selection and causality.
  The main loops have no data-dependent branches, so Triton can software-pipeline their loads.
* a mixed step (decode rows in front of prompt chunks, `decode_rows`) takes the prefill path,
  where a decode row is a tile of its own, one real row of BLOCK_T (H200, 64 decode rows beside
  a 32-token chunk: 99 µs a layer in the prefill kernel). With `mixed_decode_min_rows` set the
  decode rows take the decode path instead and the prefill kernels skip the requests in front
  (same compiled variants): two launches over disjoint rows of one output. Off by default: on
  the H100 it was no faster on the device and slower on the host (`AttentionConfig`).

Pages are walked in chunks of BLOCK_N keys that never straddle a page; when a page is smaller
than BLOCK_N (tiny test shapes) the chunk's tail is masked off, which keeps every tl.dot
dimension ≥ 16 on the GPU.
"""

from __future__ import annotations

import torch

from m3serve.kernels.triton.attention.config import (
    DECODE_MAX_EXTEND,
    DEFAULT_CONFIG,
    LOG2E,
    AttentionConfig,
    interpreted,
    next_pow2,
)
from m3serve.kernels.triton.attention.decode import decode_num_splits, launch_decode
from m3serve.kernels.triton.attention.prefill import launch_prefill

__all__ = [
    "DECODE_MAX_EXTEND",
    "DEFAULT_CONFIG",
    "AttentionConfig",
    "decode_num_splits",
    "paged_attention",
]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    scale: float,
    block_ids: torch.Tensor | None,
    max_extend: int,
    out: torch.Tensor | None = None,
    *,
    decode_rows: int = 0,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over their requests' paged KV (already written).

    q [T, Hq, D] (bf16 or fp32); k_cache/v_cache [slots, Hkv, D] (bf16, fp32 or fp8_e4m3fn);
    page_table [B, max_pages] int32 (-1 padded); seq_lens [B] int32 tokens in the cache;
    extend_starts [B + 1] int32, request b owning rows [s[b], s[b+1]); positions [T] int64;
    block_ids [T, H_idx, K] int32 logical pages (-1 padded) or None for dense causal attention;
    max_extend the longest extend length in the batch (host int, picks the path);
    decode_rows: how many requests in front have one new token each (host int; see above).
    Returns out (allocated when None) [T, Hq, D] in q's dtype. No host synchronization.
    """
    cfg = config or DEFAULT_CONFIG
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if num_q_heads % num_kv_heads or k_cache.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the KV cache {tuple(k_cache.shape)}")
    if head_dim != next_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two ≥ 16, got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV caches need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dimension")
    if num_tokens == 0:
        return out

    sparse = block_ids is not None
    if sparse:
        if block_ids.shape[0] != num_tokens or block_ids.shape[2] < 1:
            raise ValueError(f"block_ids {tuple(block_ids.shape)} for {num_tokens} tokens")
        num_idx_heads, topk = block_ids.shape[1], block_ids.shape[2]
        heads_per_idx = num_q_heads // num_idx_heads
        # One selection per GQA group: all G heads that share K/V tiles share a page list.
        if num_q_heads % num_idx_heads or heads_per_idx % group:
            raise ValueError(f"{num_idx_heads} index heads must divide the {num_kv_heads} KV heads")
        ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    else:
        num_idx_heads, topk, heads_per_idx = 1, 1, num_q_heads
        ids = page_table  # never read; any int32 tensor keeps the signature uniform
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    num_reqs = table.shape[0]

    interp = interpreted(q)
    # The interpreter's bf16 tl.dot multiplies raw bit patterns, so it computes in fp32 there.
    dot_f32 = q.dtype == torch.float32 or interp
    common = dict(
        qk_scale=float(scale) * LOG2E,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ks=k_cache.stride(0),
        stride_kh=k_cache.stride(1),
        stride_vs=v_cache.stride(0),
        stride_vh=v_cache.stride(1),
        stride_pt=table.stride(0),
        stride_it=ids.stride(0),
        stride_ih=ids.stride(1),
        D=head_dim,
        PAGE=page_size,
        BLOCK_B=max(2, next_pow2(num_reqs)),
        SPARSE=sparse,
        DOT_F32=dot_f32,
        PREC="ieee" if dot_f32 else "tf32",
    )
    if cfg.path == "decode" or (cfg.path == "auto" and max_extend <= DECODE_MAX_EXTEND):
        launch_decode(q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
                num_reqs, group, topk, heads_per_idx, cfg, common)  # fmt: skip
        return out
    split = cfg.path == "auto" and 0 < cfg.mixed_decode_min_rows <= decode_rows < num_reqs
    front = decode_rows if split else 0
    if front:
        # Rows [0, front) are requests [0, front): prefixes of every tensor, which keep their
        # addresses (so their compiled variants: Triton specializes on pointer alignment).
        rows = slice(0, front)
        launch_decode(q[rows], k_cache, v_cache, table[rows], seq_lens[rows],
                extend_starts[: front + 1], positions[rows], ids[rows] if sparse else ids,
                out[rows], front, group, topk, heads_per_idx, cfg,
                {**common, "BLOCK_B": max(2, next_pow2(front))})  # fmt: skip
    launch_prefill(q, k_cache, v_cache, table, seq_lens, extend_starts, positions, ids, out,
             num_reqs, group, topk, heads_per_idx, num_idx_heads, max_extend, cfg, common,
             first_req=front)  # fmt: skip
    return out
