"""The reference backend: every op is the exact torch reference from `m3serve.kernels`.

Runs on any device torch runs on. Weights are dequantized at load (`weight_formats` is empty);
with `keep_quantized=True` (tests of the quantized holders) they stay as stored and each op
dequantizes them exactly, which gives the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from m3serve.kernels.activation import swiglu_oai
from m3serve.kernels.attention import paged_attention
from m3serve.kernels.draft_attention import draft_attention
from m3serve.kernels.indexer import paged_index_topk
from m3serve.kernels.moe import local_expert_ids, moe_experts, route_topk
from m3serve.kernels.norm import add_gemma_rms_norm, gemma_rms_norm
from m3serve.kernels.nvfp4_tiles import untile_rows
from m3serve.kernels.quant import NVFP4_GROUP, dequant_mxfp8, unpack_e2m1
from m3serve.kernels.rope import apply_rope, rope_cos_sin
from m3serve.model.backend import HeadInputs
from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import LayerKV
from m3serve.model.weights import (
    DenseExperts,
    ExpertWeights,
    LinearWeight,
    Mxfp8Weight,
    Nvfp4Experts,
)


class ReferenceBackend:
    name = "reference"
    # The attention and indexer references loop over the batch's host-side lists.
    capturable = False

    def __init__(self, device: torch.device, keep_quantized: bool = False) -> None:
        self.device = device
        self.weight_formats = frozenset({"MXFP8", "NVFP4"} if keep_quantized else ())

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """The torch ops read the checkpoint's layouts."""

    def linear(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, Mxfp8Weight):
            weight = dequant_mxfp8(weight.codes, weight.scales).to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return gemma_rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_gemma_rms_norm(x, residual, weight, eps)

    def head_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        # Norm and rotation both in fp32 with one cast at the end.
        cos, sin = rope_cos_sin(positions, inv_freq)
        return apply_rope(gemma_rms_norm(x.float(), weight, eps), cos, sin).to(x.dtype)

    def attention_inputs(
        self,
        layer: LayerKV,
        batch: ForwardBatch,
        heads: HeadInputs,
        eps: float,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = batch.positions
        q = self.head_norm_rope(heads.q, heads.q_norm, eps, pos, inv_freq)
        index_q = None
        if heads.index_q is not None:
            assert heads.index_q_norm is not None
            index_q = self.head_norm_rope(heads.index_q, heads.index_q_norm, eps, pos, inv_freq)
        self.store_kv(
            layer, batch, heads.k, heads.v, heads.k_norm, heads.index_k, heads.index_k_norm, eps,
            inv_freq,
        )  # fmt: skip
        return q, index_q

    def store_kv(
        self,
        layer: LayerKV,
        batch: ForwardBatch,
        k: torch.Tensor,
        v: torch.Tensor,
        k_norm: torch.Tensor,
        index_k: torch.Tensor | None,
        index_k_norm: torch.Tensor | None,
        eps: float,
        inv_freq: torch.Tensor,
    ) -> None:
        """Per-head norm + RoPE of the raw keys k [T, Hkv, D] and index keys [T, Di], then
        write k, v and the index keys to the cache slots of the batch's new tokens."""
        k = self.head_norm_rope(k, k_norm, eps, batch.positions, inv_freq)
        layer.k[batch.out_slots] = k.to(layer.k.dtype)
        layer.v[batch.out_slots] = v.to(layer.v.dtype)
        if index_k is not None:
            assert layer.index_k is not None and index_k_norm is not None
            ik = self.head_norm_rope(index_k[:, None], index_k_norm, eps, batch.positions, inv_freq)
            layer.index_k[batch.out_slots] = ik[:, 0].to(layer.index_k.dtype)

    def index_topk(
        self,
        index_q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        topk: int,
        local_blocks: int,
        init_blocks: int,
    ) -> torch.Tensor:
        assert layer.index_k is not None
        return paged_index_topk(
            index_q,
            layer.index_k,
            batch.page_table,
            batch.seq_lens,
            batch.extend_lens,
            batch.positions,
            batch.page_size,
            topk,
            local_blocks,
            init_blocks,
        )

    def layer_loop(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        return nullcontext()  # nothing here is worth keeping between layers

    def attention(
        self,
        q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        scale: float,
        block_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        return paged_attention(
            q,
            layer.k,
            layer.v,
            batch.page_table,
            batch.seq_lens,
            batch.extend_lens,
            batch.positions,
            batch.page_size,
            scale,
            block_ids,
        )

    def draft_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        page_table: torch.Tensor,
        anchor_pos: torch.Tensor,
        page_size: int,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        return draft_attention(
            q, k, v, k_pool, v_pool, page_table, anchor_pos, page_size, window, scale
        )

    def swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return swiglu_oai(gate_up, alpha, limit)

    def moe(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        bias: torch.Tensor,
        experts: ExpertWeights,
        top_k: int,
        alpha: float,
        limit: float,
        scale: float,
        first_expert: int = 0,
        shared: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        weights, ids = route_topk(x, router_weight, bias, top_k)
        held = experts.w13.shape[0]
        if held != router_weight.shape[0]:
            ids = local_expert_ids(ids, first_expert, held)
        dense = dequant_experts(experts, x.dtype) if isinstance(experts, Nvfp4Experts) else experts
        routed = moe_experts(x, weights, ids, dense.w13, dense.w2, alpha, limit) * scale
        return routed if shared is None else routed + shared()


def dequant_experts(experts: Nvfp4Experts, dtype: torch.dtype) -> DenseExperts:
    """The experts' exact values: e2m1 * e4m3 (exact in fp32), then times the global scale of
    each row's half (w1 rows, w3 rows) or of w2, rounded once, as `dequant_nvfp4` does. Row-tiled
    experts (`Nvfp4Experts.tiled`) are read back in row order first. One expert at a time: a real
    layer's 128 experts at once took tens of GB for the decode's int64 codes and fp32 values."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return untile_rows(t) if experts.tiled else t

    w13_codes, w13_scale = rows(experts.w13), rows(experts.w13_scale)
    w2_codes, w2_scale = rows(experts.w2), rows(experts.w2_scale)
    half = w13_codes.shape[1] // 2
    w13 = torch.empty(
        *w13_codes.shape[:2], 2 * w13_codes.shape[2], dtype=dtype, device=w13_codes.device
    )
    w2 = torch.empty(
        *w2_codes.shape[:2], 2 * w2_codes.shape[2], dtype=dtype, device=w2_codes.device
    )
    for e in range(w13.shape[0]):
        row_global = experts.w13_global[e].repeat_interleave(half)
        w13[e] = _nvfp4_rows(w13_codes[e], w13_scale[e], row_global)
        w2[e] = _nvfp4_rows(w2_codes[e], w2_scale[e], experts.w2_global[e].expand(w2.shape[1]))
    return DenseExperts(w13, w2)


def _nvfp4_rows(codes: torch.Tensor, scale: torch.Tensor, row_global: torch.Tensor) -> torch.Tensor:
    values = unpack_e2m1(codes).unflatten(-1, (scale.shape[-1], NVFP4_GROUP))
    scaled = values * scale.to(torch.float32).unsqueeze(-1) * row_global[..., None, None]
    return scaled.flatten(-2)
