"""The Hopper (sm_90) backend: Triton kernels for the norms, fused norm/RoPE/KV writes, the
lightning indexer, sparse paged attention, the DSpark draft's block attention, the router,
the SwiGLU-OAI activation, W8A16 MXFP8 projections and the W4A16 NVFP4 fused MoE; once the
router has run, the shared expert runs on a side stream beside the routed experts.

Weights stay in the checkpoint's formats (`weight_formats`); dense (bf16) projections run as
torch matmuls and dense experts as grouped bf16 matmuls (`--moe-runner-backend torch`, or a
bf16 checkpoint). Nothing here reads the batch's host-side lists, so the engine core captures
decode steps in CUDA graphs (`capturable`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import torch

from m3serve.backends import BackendUnavailable
from m3serve.backends.hopper.moe import (
    grouped_mm_available,
    moe_experts_grouped,
    moe_experts_masked,
)
from m3serve.backends.reference import ReferenceBackend
from m3serve.kernels.moe import local_expert_ids
from m3serve.kernels.triton.launches import LayerCalls
from m3serve.model.backend import HeadInputs
from m3serve.model.batch import ForwardBatch
from m3serve.model.ffn import Experts
from m3serve.model.kv_cache import LayerKV
from m3serve.model.params import Linear
from m3serve.model.weights import ExpertWeights, LinearWeight, Mxfp8Weight, Nvfp4Experts

A = TypeVar("A")
B = TypeVar("B")


def check_hopper(device: torch.device) -> None:
    """Raise BackendUnavailable listing why this machine cannot run the Hopper backend."""
    problems = []
    if device.type != "cuda" or not torch.cuda.is_available():
        problems.append("needs a CUDA device")
    elif torch.cuda.get_device_capability(device)[0] < 9:
        name = torch.cuda.get_device_name(device)
        problems.append(f"needs compute capability >= 9.0 ({name} is below)")
    try:
        import triton  # noqa: F401
    except ImportError:
        problems.append("needs the triton package")
    if problems:
        raise BackendUnavailable("backend 'hopper' " + "; ".join(problems))


class HopperBackend(ReferenceBackend):
    """Overrides the reference ops it has kernels for; inherits the rest."""

    name = "hopper"
    capturable = True

    def __init__(
        self,
        device: torch.device,
        moe_runner: str = "auto",
        interpreter: bool = False,
        mxfp8_bf16_copy: bool = False,
    ) -> None:
        """`interpreter`: run the kernels on CPU tensors in Triton's interpreter (tests), with
        the side-stream work run in line. `mxfp8_bf16_copy`: `--mxfp8-bf16-copy`."""
        if not interpreter:
            check_hopper(device)
        from m3serve.kernels.triton import (
            attention,
            draft_attention,
            indexer,
            mxfp8_linear,
            norm,
            nvfp4_moe,
            rope_kv,
            router,
            swiglu,
        )

        super().__init__(device)
        self._attention = attention
        self._draft_attention = draft_attention
        self._indexer = indexer
        self._norm = norm
        self._rope_kv = rope_kv
        self._mxfp8 = mxfp8_linear
        self._router = router
        self._nvfp4_moe = nvfp4_moe
        self._swiglu = swiglu
        # The torch runner reads dense experts: NVFP4 ones are dequantized to bf16 at load.
        experts = {"NVFP4"} if moe_runner in ("auto", "triton") else set()
        self.weight_formats = frozenset({"MXFP8", *experts})
        self._side = None if interpreter else torch.cuda.Stream(device)
        self.layer_calls = LayerCalls()
        self.mxfp8_bf16_copy = mxfp8_bf16_copy

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """NVFP4 experts are held row-tiled (`m3serve.kernels.nvfp4_tiles`): a K step of the MoE
        kernels then reads 2 KB runs instead of a 64-byte piece of every row. With
        `--mxfp8-bf16-copy` each MXFP8 projection also gets its bf16 copy, made on the device
        one projection at a time (no dequantized model on the host)."""
        for module in model.modules():
            if isinstance(module, Experts):
                module.tile_rows_()
            if self.mxfp8_bf16_copy and isinstance(module, Linear) and module.fmt == "MXFP8":
                module.weight_bf16 = self._mxfp8.dequant_mxfp8_bf16(
                    module.weight, module.weight_scale
                )

    def linear(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, Mxfp8Weight):
            y = self._mxfp8.mxfp8_linear(x, weight.codes, weight.scales, bf16=weight.bf16)
            return y if bias is None else y + bias
        return torch.nn.functional.linear(x, weight, bias)  # the bias in cuBLAS's epilogue

    def swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return self._swiglu.swiglu_oai(gate_up, alpha, limit)

    def _beside(self, first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
        """`second` on a side stream while `first` runs on the current one (also inside a CUDA
        graph capture, where the two become parallel branches)."""
        if self._side is None:
            return first(), second()
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            b = second()
        a = first()
        main.wait_stream(self._side)
        if isinstance(b, torch.Tensor):
            b.record_stream(main)  # made on the side stream, read on this one
        return a, b

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.add_rms_norm(x, residual, weight, eps)

    def head_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        return self._rope_kv.norm_rope(x, weight, eps, positions, inv_freq)

    def attention_inputs(
        self,
        layer: LayerKV,
        batch: ForwardBatch,
        heads: HeadInputs,
        eps: float,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        index = None
        if heads.index_q is not None:
            assert heads.index_q_norm is not None and heads.index_k is not None
            assert heads.index_k_norm is not None and layer.index_k is not None
            index = (heads.index_q, heads.index_q_norm, heads.index_k, heads.index_k_norm,
                     layer.index_k)  # fmt: skip
        return self._rope_kv.norm_rope_heads(
            heads.q, heads.q_norm, heads.k, heads.v, heads.k_norm, eps, batch.positions,
            inv_freq, batch.out_slots, layer.k, layer.v, index,
        )  # fmt: skip

    def layer_loop(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        # The first layer's attention launches are replayed for the others (kernels/triton/
        # launches.py): the batch, so the kernel variants, grids and scratch, stay the same.
        return self.layer_calls.scope(batch)

    def index_topk(
        self,
        index_q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        topk: int,
        local_blocks: int,
        init_blocks: int,
    ) -> torch.Tensor:
        index_k = layer.index_k
        assert index_k is not None and batch.seq_lens_t is not None

        def call() -> torch.Tensor:
            return self._indexer.index_topk(
                index_q,
                index_k,
                batch.page_table,
                batch.seq_lens_t,
                batch.extend_starts,
                batch.positions,
                batch.page_size,
                topk,
                local_blocks,
                init_blocks,
                batch.page_table.shape[1],
            )

        key = ("index_topk", topk, local_blocks, init_blocks)
        return self.layer_calls.run(batch, key, (index_q, index_k), call)

    def attention(
        self,
        q: torch.Tensor,
        layer: LayerKV,
        batch: ForwardBatch,
        scale: float,
        block_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        assert batch.seq_lens_t is not None
        out = torch.empty_like(q)

        def call() -> torch.Tensor:
            return self._attention.paged_attention(
                q,
                layer.k,
                layer.v,
                batch.page_table,
                batch.seq_lens_t,
                batch.extend_starts,
                batch.positions,
                batch.page_size,
                scale,
                block_ids,
                batch.max_extend,
                out,
                decode_rows=batch.decode_rows,
            )

        # What differs from layer to layer; all else the call reads is the batch's.
        mine = (q, layer.k, layer.v, out)
        inputs = mine if block_ids is None else (*mine, block_ids)
        key = ("attention", scale, block_ids is None)
        return self.layer_calls.run(batch, key, inputs, call)

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
        return self._draft_attention.draft_attention(
            q, k, v, k_pool, v_pool, page_table, anchor_pos, page_size, window, scale
        )

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
        # Routing first, on the critical path alone: beside the shared expert's GEMVs (which
        # fill the GPU) it waited for them (H200, batch 1: 185 -> 165 µs per layer, then the
        # routed experts and the shared expert overlap instead).
        # The routed scaling factor rides on the mixing weights (2.0: exact).
        weights, ids = self._router.route(x, router_weight, bias, top_k, scale)
        held = experts.w13.shape[0]
        partial = held != router_weight.shape[0]
        if partial:  # expert parallelism: pairs routed to other ranks' experts are skipped
            ids = local_expert_ids(ids, first_expert, held)

        def routed() -> torch.Tensor:
            return self._routed(x, weights, ids, experts, alpha, limit, partial)

        if shared is None:
            return routed()
        out, extra = self._beside(routed, shared)
        return out + extra

    def _routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        experts: ExpertWeights,
        alpha: float,
        limit: float,
        partial: bool,
    ) -> torch.Tensor:
        if isinstance(experts, Nvfp4Experts):
            e = experts
            if not e.tiled:
                raise ValueError("the NVFP4 MoE reads row-tiled experts: see prepare_weights")
            return self._nvfp4_moe.nvfp4_moe(
                x, weights, ids, e.w13, e.w13_scale, e.w13_global, e.w2, e.w2_scale,
                e.w2_global, alpha, limit, skips=partial,
            )  # fmt: skip
        # The grouped path sorts every pair into an expert's group; skipped ones have none,
        # so dense experts under expert parallelism take the masked path (every held expert
        # over every token: exact, slow at real sizes; NVFP4 experts are the served case).
        if grouped_mm_available(x.device, x.dtype) and not partial:
            return moe_experts_grouped(x, weights, ids, experts.w13, experts.w2, alpha, limit)
        return moe_experts_masked(x, weights, ids, experts.w13, experts.w2, alpha, limit)
