"""Piecewise ("breakable") CUDA graphs for prefill and mixed steps.

A step with prompt chunks in it cannot replay a decode graph: its attention depends on each
request's extend length, cached prefix and page table, which a graph would freeze. Everything
else in a layer (norms, projections, RoPE and the KV writes, router and experts) depends only on
the token count. So a step of T tokens is padded to a bucket of B >= T tokens and runs as
`num_layers + 1` captured pieces, with attention run eagerly on the T real rows in between
(SGLang's `--cuda-graph-backend-prefill breakable`):

    piece 0      embed; layer 0 up to its attention inputs (q, index q; K, V written)
    attend 0     eager
    piece i      layer i-1 from its attention output (o_proj, norm, FFN); layer i up to attention
    attend i     eager
    piece L      the last layer's second half and the final norm

What an eager step pays per layer in Python and launch overhead (tens of kernels) shrinks to a
replay and the few attention launches; and from the second layer on, those are the first
layer's launches repeated with the layer's tensors (`HopperBackend.layer_loop`).

Pieces pass tensors through static buffers sized for the largest bucket, shared by every bucket
and layer, so memory does not grow with the layer count. Padding rows are token 0 at position 0,
written to the scratch page no request owns. Outside attention rows never mix, so padding cannot
change a real row; the attention output of padding rows is whatever finite values an earlier
step left there.

Without CUDA (`capture=False`, tests) the pieces run eagerly over the same buffers, so the
split and the padding are checked on the CPU against the plain forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from m3serve.core.graph_set import capture_graph, capture_stream
from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM

log = logging.getLogger(__name__)

# Token buckets, 16 apart up to 256 and then at most 1/8 of a step apart: padding is real work
# in a compute-bound prefill. Past the largest one a step runs eagerly, where its device time
# hides the launches anyway.
BUCKETS = (
    *range(16, 256, 16),
    *range(256, 512, 32),
    *range(512, 1024, 64),
    *range(1024, 2048, 128),
    *range(2048, 4096 + 1, 256),
)
DEFAULT_MAX_TOKENS = 4096


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets below `max_tokens`, and `max_tokens` itself as the last one."""
    return [*(b for b in BUCKETS if b < max_tokens), max_tokens]


@dataclass
class _Buffers:
    """Inputs and the tensors pieces hand each other, for the largest bucket."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    out_slots: torch.Tensor  # [N] int64
    q: torch.Tensor  # [N, Hq, D]
    index_q: torch.Tensor | None  # [N, H_idx, D_idx]; None without sparse layers
    attn: torch.Tensor  # [N, q_size], the eager attention's output
    residual: torch.Tensor  # [N, hidden]
    hidden: torch.Tensor  # [N, hidden], the final-normed output


class PiecewiseGraphs:
    def __init__(
        self,
        model: M3ForCausalLM,
        kv: KVCache,
        scratch_page: int,
        max_tokens: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv = kv
        self.scratch_slot = scratch_page * kv.page_size
        self.sizes = token_buckets(max_tokens)
        self.capture_graphs = capture
        self.buffers = self._allocate(max_tokens)
        # replays[bucket][i] replays piece i's graph; empty until `capture` (or without CUDA).
        self.replays: dict[int, list[Callable[[], None]]] = {}
        self.pool = None
        self._no_pages = torch.empty((0, 0), dtype=torch.int32, device=model.device)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens <= self.max_tokens

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Run every bucket's pieces once (compiling their kernels), then capture them, the
        largest bucket first so that smaller ones reuse its memory pool."""
        if not self.capture_graphs:
            return
        device = self.model.device
        with capture_stream(device) as stream, torch.inference_mode():
            for size in reversed(self.sizes):
                self._pad(0, size)
                pieces = self._pieces(size)
                for piece in pieces:  # in order: each piece reads what the one before wrote
                    piece()
                torch.cuda.synchronize(device)
                self.replays[size] = [self._capture_one(piece, stream) for piece in pieces]
        log.info("captured piecewise CUDA graphs for %d token buckets up to %d",
                 len(self.sizes), self.max_tokens)  # fmt: skip

    def _capture_one(
        self, piece: Callable[[], None], stream: torch.cuda.Stream
    ) -> Callable[[], None]:
        graph, _, self.pool = capture_graph(piece, stream, self.pool, warm=False)
        return graph.replay

    # ------------------------------------------------------------------ replay

    @torch.inference_mode()
    def run(
        self, batch: ForwardBatch, before_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the batch's tokens. `before_layer(i)` runs
        before layer i reads the cache (HiCache load-back); the new tokens' K/V, written in
        the piece before it, go to pages no load-back writes."""
        tokens = batch.num_tokens
        size = next(s for s in self.sizes if s >= tokens)
        buf = self.buffers
        buf.input_ids[:tokens].copy_(batch.input_ids)
        buf.positions[:tokens].copy_(batch.positions)
        buf.out_slots[:tokens].copy_(batch.out_slots)
        self._pad(tokens, size)
        pieces = self.replays[size] if self.capture_graphs else self._pieces(size)
        with self.model.backend.layer_loop(batch):
            for i, layer in enumerate(self.model.layers):
                pieces[i]()
                if before_layer is not None:
                    before_layer(i)
                index_q = buf.index_q[:tokens] if layer.self_attn.sparse else None
                buf.attn[:tokens].copy_(layer.attend(buf.q[:tokens], index_q, batch, self.kv))
        pieces[-1]()
        return buf.hidden[:tokens]

    def _pad(self, tokens: int, size: int) -> None:
        """Rows [tokens, size): token 0 at position 0, written to the scratch page."""
        buf = self.buffers
        buf.input_ids[tokens:size].zero_()
        buf.positions[tokens:size].zero_()
        buf.out_slots[tokens:size].fill_(self.scratch_slot)

    # ------------------------------------------------------------------ pieces

    def _pieces(self, size: int) -> list[Callable[[], None]]:
        layers = self.model.layers
        pieces = [lambda: self._first(size)]
        pieces += [lambda i=i: self._between(size, i) for i in range(1, len(layers))]
        pieces.append(lambda: self._last(size))
        return pieces

    def _first(self, size: int) -> None:
        hidden = self.model.embed(self.buffers.input_ids[:size])
        self._attention_inputs(size, 0, hidden, None)

    def _between(self, size: int, layer: int) -> None:
        hidden, residual = self._finish(size, layer - 1)
        self._attention_inputs(size, layer, hidden, residual)

    def _last(self, size: int) -> None:
        hidden, residual = self._finish(size, len(self.model.layers) - 1)
        self.buffers.hidden[:size].copy_(self.model.final_norm(hidden, residual))

    def _attention_inputs(
        self, size: int, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        buf = self.buffers
        q, index_q, residual = self.model.layers[layer].attention_inputs(
            hidden, residual, self._static_batch(size), self.kv, self.model.inv_freq
        )
        buf.q[:size].copy_(q)
        if index_q is not None:
            assert buf.index_q is not None
            buf.index_q[:size].copy_(index_q)
        buf.residual[:size].copy_(residual)

    def _finish(self, size: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self.buffers
        return self.model.layers[layer].finish(buf.attn[:size], buf.residual[:size])

    def _static_batch(self, size: int) -> ForwardBatch:
        """What the captured half-layers read of a batch: positions and cache slots."""
        buf = self.buffers
        return ForwardBatch(
            input_ids=buf.input_ids[:size],
            positions=buf.positions[:size],
            out_slots=buf.out_slots[:size],
            page_table=self._no_pages,
            seq_lens=[],
            extend_lens=[],
            logit_rows=buf.input_ids[:0],
            page_size=self.kv.page_size,
        )

    def _allocate(self, n: int) -> _Buffers:
        cfg, model = self.model.cfg, self.model
        device, dtype = model.device, model.dtype

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        sparse = any(cfg.is_sparse(i) for i in range(cfg.num_layers))
        return _Buffers(
            input_ids=zeros(n, dtype=torch.int64),
            positions=zeros(n, dtype=torch.int64),
            out_slots=torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device),
            q=zeros(n, cfg.num_heads, cfg.head_dim),
            index_q=zeros(n, cfg.index_n_heads, cfg.index_head_dim) if sparse else None,
            attn=zeros(n, cfg.q_size),
            residual=zeros(n, cfg.hidden_size),
            hidden=zeros(n, cfg.hidden_size),
        )
