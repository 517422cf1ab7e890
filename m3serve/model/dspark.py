"""The DSpark draft network of MiniMax-M3.1 (model-m3.md §D.2): one forward proposes a block of
`block_size` (7) tokens after the last committed token, the anchor.

* Target features: the residual streams (hidden + residual, before any norm) of the target
  layers `target_layer_ids`, concatenated per token, become `ctx = hidden_norm(fc(features))`.
* Each of the dense draft layers keys its *context* from `ctx` without its input_layernorm:
  `k = rope(k_norm(k_proj(ctx)))`, `v = v_proj(ctx)`.
* The query block is [anchor, noise × (block_size − 1)] at positions anchor, anchor + 1, …,
  embedded with the target's embedding. In every layer the block attends, non-causally, to
  itself and to the context strictly before the anchor, within the sliding window (a query at
  q sees context keys in [q − (sliding_window − 1), q)), as SGLang's bidirectional draft does.
* `h = final_norm(out)`, base logits `z_k = lm_head(h_k)` (the target's); slot k predicts the
  token at anchor + k + 1 after the vanilla Markov correction, slot by slot:
  `logits_k = z_k + markov_w2 · markov_w1[prev_k]`, prev_0 = anchor, prev_k = the token chosen
  at slot k − 1 (argmax, or a sample at the given temperature).

This is the torch reference for one request: the draft context is a dense per-layer K/V
tensor (`DraftContext`). The engine runs the same layers batched over requests on a paged
draft KV pool (model/dspark_paged.py), whose attention is the backend's `draft_attention`; this
per-request reference calls the reference op `kernels.attention.attention`, and every other op
through the backend.
The confidence head is loaded when present but not evaluated (§D.2.8: not needed for
correctness). Where §D is silent (window bounds) this follows SGLang's DSpark port.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from m3serve.kernels.attention import attention
from m3serve.kernels.rope import rope_inv_freq
from m3serve.model.backend import Backend
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.ffn import DenseMLP
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.params import Linear, Norm, Table, weight
from m3serve.model.weights import WeightFormats

# Checkpoint module prefix of the draft's tensors (without `language_model.`).
MODULE_PREFIX = "model.dspark."


@dataclass(frozen=True)
class SharedHead:
    """The target's embedding and LM head, used by the draft in place (never copied)."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [T] -> [T, H]
    logits: Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> fp32 [T, V]


@dataclass(frozen=True)
class DraftContext:
    """One request's draft K/V: per draft layer [S, Hkv, D], at `positions` [S]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    positions: torch.Tensor


@dataclass(frozen=True)
class DraftProposal:
    tokens: torch.Tensor  # [block_size] int64: slot k proposes the token at anchor + k + 1
    logits: torch.Tensor  # [block_size, V] fp32, Markov-corrected: the draft distribution q
    hidden: torch.Tensor  # [block_size, H] final-normed (the confidence head's input)


class DraftLayer(nn.Module):
    """One dense M3 decoder layer; `base` is its checkpoint module (`...layers.0.decoder_layer`)."""

    def __init__(
        self,
        cfg: DSparkConfig,
        base: str,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: WeightFormats,
    ) -> None:
        super().__init__()
        c = cfg.layers
        self.cfg, self.backend = c, backend
        h, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = Norm(h, eps, dtype, device)
        self.post_attention_layernorm = Norm(h, eps, dtype, device)
        attn = f"{base}.self_attn."
        self.splits = [c.q_size, c.kv_size, c.kv_size]
        qkv = formats.of([attn + p for p in ("q_proj", "k_proj", "v_proj")])
        self.qkv_proj = Linear(h, sum(self.splits), dtype, device, qkv)
        self.o_proj = Linear(c.q_size, h, dtype, device, formats.of([attn + "o_proj"]))
        self.q_norm = Norm(c.head_dim, eps, dtype, device)
        self.k_norm = Norm(c.head_dim, eps, dtype, device)
        width = c.dense_intermediate_size
        self.mlp = DenseMLP(c, width, backend, dtype, device, formats, f"{base}.mlp")

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], rotated k [T, Hkv, D] and v of already-normed inputs x [T, H]."""
        c, b = self.cfg, self.backend
        q, k, v = b.linear(x, self.qkv_proj.data).split(self.splits, dim=-1)
        n = x.shape[0]
        q = b.head_norm_rope(
            q.view(n, c.num_heads, c.head_dim),
            self.q_norm.weight,
            self.q_norm.eps,
            positions,
            inv_freq,
        )
        k = b.head_norm_rope(
            k.view(n, c.num_kv_heads, c.head_dim),
            self.k_norm.weight,
            self.k_norm.eps,
            positions,
            inv_freq,
        )
        return q, k, v.reshape(n, c.num_kv_heads, c.head_dim)

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The context is keyed from ctx itself: no input_layernorm (§D.2.2). Its queries are
        # computed and dropped; a separate k/v-only weight view is a later optimization.
        _, k, v = self.project(ctx, positions, inv_freq)
        return k, v

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        allowed: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """o_proj(attention) of the block's normed inputs x [n, H] over [context ++ block]."""
        q, k, v = self.project(x, positions, inv_freq)
        keys, values = torch.cat((ctx_k.to(k.dtype), k)), torch.cat((ctx_v.to(v.dtype), v))
        out = attention(q, keys, values, allowed[None], self.cfg.head_dim**-0.5)
        return self.backend.linear(out.reshape(x.shape[0], -1), self.o_proj.data)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        allowed: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.backend
        norm = self.input_layernorm
        x, residual = b.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.attend(x, positions, ctx_k, ctx_v, allowed, inv_freq)
        norm = self.post_attention_layernorm
        x, residual = b.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class DSparkDraft(nn.Module):
    """Parameter names are the checkpoint's (minus `language_model.model.dspark.` and the
    `.decoder_layer` infix), with q/k/v and gate/up fused as in the target."""

    def __init__(
        self,
        cfg: DSparkConfig,
        shared: SharedHead,
        backend: Backend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        formats: WeightFormats | None = None,
    ) -> None:
        super().__init__()
        c = cfg.layers
        formats = formats or WeightFormats()
        self.cfg, self.shared, self.backend = cfg, shared, backend
        h, eps = c.hidden_size, c.rms_norm_eps
        self.fc = Linear(cfg.feature_size, h, dtype, device, formats.of([MODULE_PREFIX + "fc"]))
        self.hidden_norm = Norm(h, eps, dtype, device)
        self.final_norm = Norm(h, eps, dtype, device)
        self.layers = nn.ModuleList(
            DraftLayer(
                cfg, f"{MODULE_PREFIX}layers.{i}.decoder_layer", backend, dtype, device, formats
            )
            for i in range(c.num_layers)
        )
        self.markov_w1 = Table(c.vocab_size, cfg.markov_rank, dtype, device)
        self.markov_w2 = Table(c.vocab_size, cfg.markov_rank, dtype, device)
        if cfg.confidence_head:
            self.confidence_weight = weight(1, h + cfg.markov_rank, dtype=dtype, device=device)
            self.confidence_bias = weight(1, dtype=dtype, device=device)
        self.register_buffer(
            "inv_freq", rope_inv_freq(c.rotary_dim, c.rope_theta, device), persistent=False
        )

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> DraftContext:
        """The draft K/V of committed tokens from their target features [S, feature_size]."""
        b = self.backend
        ctx = b.rms_norm(
            b.linear(features, self.fc.data), self.hidden_norm.weight, self.hidden_norm.eps
        )
        kv = [layer.context_kv(ctx, positions, self.inv_freq) for layer in self.layers]
        return DraftContext([k for k, _ in kv], [v for _, v in kv], positions)

    def block_mask(self, context_positions: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        """Allowed keys [block_size, S + block_size]: context strictly before the anchor and
        within each slot's window; the whole block, both ways."""
        q = anchor_pos + torch.arange(self.cfg.block_size, device=context_positions.device)
        p = context_positions[None, :]
        ctx = (p < anchor_pos) & (q[:, None] - p < self.cfg.sliding_window)
        block = torch.ones(len(q), len(q), dtype=torch.bool, device=q.device)
        return torch.cat((ctx, block), dim=1)

    def block_hidden(
        self, anchor_token: int, anchor_pos: int, context: DraftContext
    ) -> torch.Tensor:
        """Final-normed hidden states [block_size, H] of [anchor, noise × (block_size − 1)]."""
        cfg = self.cfg
        device = self.inv_freq.device
        ids = torch.full((cfg.block_size,), cfg.noise_token_id, dtype=torch.int64, device=device)
        ids[0] = anchor_token
        positions = anchor_pos + torch.arange(cfg.block_size, device=device)
        allowed = self.block_mask(context.positions, anchor_pos)
        hidden, residual = self.shared.embed(ids), None
        for layer, k, v in zip(self.layers, context.k, context.v, strict=True):
            hidden, residual = layer(hidden, residual, positions, k, v, allowed, self.inv_freq)
        norm = self.final_norm
        return self.backend.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """fp32 [n, V] logit correction for the previous tokens prev [n]."""
        return self.backend.linear(self.markov_w1.weight[prev], self.markov_w2.weight).float()

    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        context: DraftContext,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        """One draft block. temperature 0 is greedy; otherwise each slot samples from its
        Markov-corrected logits / temperature (the returned logits stay unscaled)."""
        hidden = self.block_hidden(anchor_token, anchor_pos, context)
        base = self.shared.logits(hidden)
        prev = torch.tensor([anchor_token], dtype=torch.int64, device=hidden.device)
        tokens, logits = [], []
        # Slot by slot: slot k's correction needs the token chosen at slot k − 1.
        for k in range(self.cfg.block_size):
            step = base[k : k + 1] + self.markov_bias(prev)
            if temperature <= 0:
                prev = step.argmax(dim=-1)
            else:
                probs = torch.softmax(step / temperature, dim=-1)
                prev = torch.multinomial(probs, 1, generator=generator)[:, 0]
            tokens.append(prev)
            logits.append(step)
        return DraftProposal(torch.cat(tokens), torch.cat(logits), hidden)


def shared_head(target: M3ForCausalLM) -> SharedHead:
    return SharedHead(embed=target.embed, logits=target.compute_logits)


def target_features(
    target: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layer_ids: Sequence[int]
) -> torch.Tensor:
    """Run the target over `batch` and return the concatenated residual streams of `layer_ids`
    for every new token, [T, len(layer_ids) * H] (the output of layer L is its hidden +
    residual, before any norm)."""
    wanted = {layer: i for i, layer in enumerate(layer_ids)}
    taken: list[torch.Tensor | None] = [None] * len(layer_ids)
    hidden, residual = target.input_embeds(batch), None
    for layer in target.layers[: max(layer_ids) + 1]:
        hidden, residual = layer(hidden, residual, batch, kv, target.inv_freq)
        if layer.index in wanted:
            taken[wanted[layer.index]] = hidden + residual
    return torch.cat(taken, dim=-1)  # type: ignore[arg-type]
