"""The DSpark draft (model/dspark.py) batched over requests, its context read from a paged draft
KV pool instead of a per-request `DraftContext`.

The pool is page-aligned with the target's KV pool: the draft K/V of the token at position s of
a request lives at the same physical slot as that token's target K/V, so one page table, the
radix tree and the page accounting serve both (SGLang keeps its draft KV the same way).
`write_context` keys committed tokens from their target features; `propose` runs one block per
request, all requests at once: the attention through the backend's `draft_attention` (each
block over its window of context read through its page table, and over itself). The hidden
states, base logits and greedy tokens are device ops only, so a capturable backend can record
them in a CUDA graph (core/spec/draft_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark import DSparkDraft
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM


@dataclass
class DraftKV:
    """Per draft layer K and V [slots, kv_heads, head_dim], slots as in the target's pool."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(
        cls,
        cfg: DSparkConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> DraftKV:
        c = cfg.layers
        shape = (num_pages * page_size, c.num_kv_heads, c.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        return cls(k, v, page_size)

    @staticmethod
    def bytes_per_page(cfg: DSparkConfig, page_size: int, dtype: torch.dtype) -> int:
        c = cfg.layers
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * page_size * item


@dataclass(frozen=True)
class BlockProposal:
    tokens: torch.Tensor  # [B, block_size] int64: slot k proposes the token at anchor + k + 1
    # [B, block_size, V] fp32 Markov-corrected, unscaled: the draft's q. None for an all-greedy
    # proposal replayed from a CUDA graph (greedy verification never reads q).
    logits: torch.Tensor | None


def write_context(
    draft: DSparkDraft,
    kv: DraftKV,
    features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Key committed tokens: their target features [N, feature_size] at `positions` [N] become
    every draft layer's context K/V at KV `slots` [N]."""
    if features.shape[0] == 0:
        return
    b = draft.backend
    norm = draft.hidden_norm
    ctx = b.rms_norm(b.linear(features, draft.fc.data), norm.weight, norm.eps)
    for layer, k_pool, v_pool in zip(draft.layers, kv.k, kv.v, strict=True):
        k, v = layer.context_kv(ctx, positions, draft.inv_freq)
        k_pool[slots] = k.to(k_pool.dtype)
        v_pool[slots] = v.to(v_pool.dtype)


def block_hidden(
    draft: DSparkDraft,
    kv: DraftKV,
    anchors: torch.Tensor,
    anchor_pos: torch.Tensor,
    page_table: torch.Tensor,
) -> torch.Tensor:
    """Final-normed hidden states [B, block_size, H] of every request's query block
    [anchor, noise × (block_size − 1)] at anchor_pos [B] (a device tensor); `page_table`
    [B, P] (−1 padded) names each request's pages. Device ops only (CUDA-graph capturable on a
    capturable backend)."""
    cfg, b = draft.cfg, draft.backend
    c, n, block = cfg.layers, anchors.shape[0], cfg.block_size
    device = anchors.device
    ids = torch.full((n, block), cfg.noise_token_id, dtype=torch.int64, device=device)
    ids[:, 0] = anchors
    offsets = torch.arange(block, device=device)
    positions = (anchor_pos.long()[:, None] + offsets).reshape(-1)
    hidden, residual = draft.shared.embed(ids.reshape(-1)), None
    scale = c.head_dim**-0.5
    for layer, k_pool, v_pool in zip(draft.layers, kv.k, kv.v, strict=True):
        norm = layer.input_layernorm
        x, residual = b.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        q, k, v = layer.project(x, positions, draft.inv_freq)
        out = b.draft_attention(
            q, k, v, k_pool, v_pool, page_table, anchor_pos, kv.page_size,
            cfg.sliding_window, scale,
        )  # fmt: skip
        hidden = b.linear(out.reshape(n * block, -1), layer.o_proj.data)
        norm = layer.post_attention_layernorm
        x, residual = b.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = layer.mlp(x)
    norm = draft.final_norm
    return b.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0].view(n, block, -1)


def base_logits(
    draft: DSparkDraft,
    kv: DraftKV,
    anchors: torch.Tensor,
    anchor_pos: torch.Tensor,
    page_table: torch.Tensor,
) -> torch.Tensor:
    """fp32 [B, block_size, V]: the LM head over `block_hidden`, before the Markov correction."""
    hidden = block_hidden(draft, kv, anchors, anchor_pos, page_table)
    n, block = hidden.shape[:2]
    return draft.shared.logits(hidden.reshape(n * block, -1)).view(n, block, -1)


def greedy_tokens(draft: DSparkDraft, base: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[B, block_size] int64: each slot's argmax after the Markov correction for the token the
    slot before chose (device ops only; the corrected logits are not kept)."""
    prev = anchors.to(torch.int64)
    tokens = []
    for k in range(base.shape[1]):
        prev = (base[:, k] + draft.markov_bias(prev)).argmax(dim=-1)
        tokens.append(prev)
    return torch.stack(tokens, dim=1)


def propose(
    draft: DSparkDraft,
    kv: DraftKV,
    anchors: torch.Tensor,
    anchor_pos: list[int] | torch.Tensor,
    page_table: torch.Tensor,
    temperatures: list[float],
    generators: list[torch.Generator | None],
) -> BlockProposal:
    """One draft block per request. Temperature 0 takes each slot's argmax; otherwise the slot
    draws from softmax(logits / temperature) with the row's generator (None: torch's default)."""
    pos = torch.as_tensor(anchor_pos, dtype=torch.int64, device=anchors.device)
    base = base_logits(draft, kv, anchors, pos, page_table)
    prev = anchors.to(torch.int64)
    tokens, logits = [], []
    # Slot by slot: slot k's Markov correction needs the token chosen at slot k − 1.
    for k in range(base.shape[1]):
        step = base[:, k] + draft.markov_bias(prev)
        prev = step.argmax(dim=-1)
        for row, temperature in enumerate(temperatures):
            if temperature > 0:
                probs = torch.softmax(step[row] / temperature, dim=-1)
                prev[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
        tokens.append(prev)
        logits.append(step)
    return BlockProposal(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))


def target_pass(
    target: M3ForCausalLM,
    batch: ForwardBatch,
    kv: KVCache,
    layer_ids: Sequence[int],
    before_layer: Callable[[int], None] | None = None,
    only: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward over `batch` that also keeps what the draft reads: final-normed
    hidden states [T, H] of every new token, and the concatenated residual streams of
    `layer_ids` [T, len(layer_ids) * H] (layer L's output is its hidden + residual, before
    any norm). `before_layer(i)` is called as layer i starts (HiCache load-backs). `only`
    runs just those layers (the warm-up: one of each kind compiles what every layer needs); a
    draft layer skipped then gives the stream as it stands, of the same shape."""
    wanted = {layer: i for i, layer in enumerate(layer_ids)}
    taken: list[torch.Tensor | None] = [None] * len(layer_ids)
    hidden, residual = target.input_embeds(batch), None
    run = None if only is None else set(only)
    with target.backend.layer_loop(batch):
        for layer in target.layers:
            if run is None or layer.index in run:
                if before_layer is not None:
                    before_layer(layer.index)
                hidden, residual = layer(hidden, residual, batch, kv, target.inv_freq)
            if layer.index in wanted:
                taken[wanted[layer.index]] = hidden if residual is None else hidden + residual
    features = torch.cat(taken, dim=-1)  # type: ignore[arg-type]
    return target.final_norm(hidden, residual), features
