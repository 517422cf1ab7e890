"""The MiniMax-M3.1 text backbone with its LM head, over paged KV; on one rank or spread over
a tensor-parallel group (`model/parallel.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from m3serve.kernels.rope import rope_inv_freq
from m3serve.model.attention import Attention
from m3serve.model.backend import Backend
from m3serve.model.batch import ForwardBatch
from m3serve.model.config import TextConfig
from m3serve.model.ffn import DenseMLP, MoE
from m3serve.model.kv_cache import KVCache
from m3serve.model.parallel import SINGLE, Parallel, vocab_parallel_embed
from m3serve.model.params import Norm, Table
from m3serve.model.vision.config import VisionConfig
from m3serve.model.vision.encoder import VisionEncoder
from m3serve.model.weights import WeightFormats


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        index: int,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.index = index
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, index, backend, dtype, device, formats, parallel)
        self.is_moe = cfg.is_moe(index)
        # Attribute names follow the checkpoint: `block_sparse_moe` on MoE layers, `mlp` otherwise.
        base = f"model.layers.{index}"
        if self.is_moe:
            moe = base + ".block_sparse_moe"
            self.block_sparse_moe = MoE(cfg, backend, dtype, device, formats, moe, parallel)
        else:
            width, mlp = cfg.dense_intermediate_size, base + ".mlp"
            self.mlp = DenseMLP(cfg, width, backend, dtype, device, formats, mlp, parallel)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVCache,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, index_q, residual = self.attention_inputs(hidden, residual, batch, kv, inv_freq)
        return self.finish(self.attend(q, index_q, batch, kv), residual)

    # The three parts below are the layer split where it reads per-request metadata (`attend`)
    # and where it does not (the rest): piecewise CUDA graphs capture the latter.

    def attention_inputs(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVCache,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Queries, index queries and the residual stream; K/V written to the cache."""
        norm = self.input_layernorm
        x, residual = self.backend.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        q, index_q = self.self_attn.project(x, batch, kv.layers[self.index], inv_freq)
        return q, index_q, residual

    def attend(
        self, q: torch.Tensor, index_q: torch.Tensor | None, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        return self.self_attn.attend(q, index_q, batch, kv.layers[self.index])

    def finish(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention output to the layer's output: o_proj, norm, feed-forward."""
        hidden = self.self_attn.output(attn)
        norm = self.post_attention_layernorm
        x, residual = self.backend.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return ffn(x), residual


class Backbone(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        vocab = parallel.vocab(cfg).size
        self.embed_tokens = Table(vocab, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, backend, dtype, device, formats, parallel)
            for i in range(cfg.num_layers)
        )
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class M3ForCausalLM(nn.Module):
    """Parameter names mirror the checkpoint's `language_model.*` names (minus that prefix),
    except where the loader fuses tensors: q/k/v + indexer projections, gate/up projections and
    the stacked experts. `formats` says which weights stay in the checkpoint's quantized format
    (default: every weight dense); `parallel` which slice of each weight this rank holds
    (default: all of them, on one rank). With `vision` the model also holds the vision tower
    and projector (`vision`, loaded from the checkpoint's `vision_tower.*` / projector names),
    whose features replace placeholder embeddings (`ForwardBatch.embeds_override`)."""

    def __init__(
        self,
        cfg: TextConfig,
        backend: Backend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        formats: WeightFormats | None = None,
        parallel: Parallel = SINGLE,
        vision: VisionConfig | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.dtype = dtype
        self.parallel = parallel
        self.vocab = parallel.vocab(cfg)
        # The KV heads this rank caches (the KV cache is allocated with this many).
        self.kv_heads = parallel.kv_heads(cfg).size
        self.model = Backbone(cfg, backend, dtype, device, formats or WeightFormats(), parallel)
        self.lm_head = Table(self.vocab.size, cfg.hidden_size, dtype, device)
        self.vision = VisionEncoder(vision, backend, dtype, device) if vision else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, device), persistent=False
        )

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        layers: Sequence[int] | None = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(batch.logit_rows), vocab]. `layers` runs only
        those layers (the warm-up compiles each distinct layer shape once)."""
        hidden = self.hidden_states(batch, kv, layers, before_layer)
        return self.compute_logits(hidden[batch.logit_rows])

    def hidden_states(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        layers: Sequence[int] | None = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of every new token [T, hidden]. `before_layer(i)` is
        called as layer i starts (HiCache: wait until that layer's KV pages are loaded)."""
        hidden = self.input_embeds(batch)
        residual: torch.Tensor | None = None
        chosen = self.model.layers if layers is None else [self.model.layers[i] for i in layers]
        with self.backend.layer_loop(batch):
            for layer in chosen:
                if before_layer is not None:
                    before_layer(layer.index)
                hidden, residual = layer(hidden, residual, batch, kv, self.inv_freq)
        return self.final_norm(hidden, residual)

    @property
    def layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def input_embeds(self, batch: ForwardBatch) -> torch.Tensor:
        """The first layer's input: token embeddings, with image/video features in place of
        their placeholder tokens' embeddings."""
        hidden = self.embed(batch.input_ids)
        if batch.override_rows is not None and batch.embeds_override is not None:
            hidden = hidden.index_copy(0, batch.override_rows, batch.embeds_override.to(hidden))
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.model.embed_tokens.weight
        if not self.parallel.enabled:
            return table[input_ids]
        return vocab_parallel_embed(table, input_ids, self.vocab, self.parallel.ranks)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        norm = self.model.norm
        return self.backend.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the full vocabulary (each rank's rows gathered from all ranks)."""
        logits = self.backend.linear(hidden, self.lm_head.weight).float()
        return self.parallel.ranks.all_gather(logits, dim=-1)
