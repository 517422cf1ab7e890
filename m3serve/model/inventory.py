"""The checkpoint's tensor inventory for a config: every logical weight of the text backbone,
its checkpoint name and shape, and where it lands in `M3ForCausalLM`.

The loader checks a checkpoint against this list and `make-tiny` writes exactly this list, so the
two can never disagree about names; the transformers parity tests check the names themselves.

With tensor/expert parallelism the list is one rank's: each entry names the `part` of the
checkpoint tensor the rank reads and where it lands in the rank's (smaller) parameters; experts
the rank does not hold are left out. The single-rank list reads every tensor whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from m3serve.model.attention import QKV_PROJECTIONS, qkv_rows
from m3serve.model.config import TextConfig
from m3serve.model.parallel import SINGLE, Parallel, Shard
from m3serve.model.weights import CHECKPOINT_PREFIX

Kind = Literal["linear", "norm", "table", "router", "bias"]

PREFIX = CHECKPOINT_PREFIX
# Checkpoint parts that belong to other issues' features: accepted and skipped here.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
IGNORED_PREFIXES = ("language_model.model.mtp.", "model.mtp.")


@dataclass(frozen=True)
class Part:
    """A rank's slice of a checkpoint tensor: `shard` of dimension `dim` (0: rows, 1: inputs)."""

    dim: int
    shard: Shard

    def packed(self, per_column: int) -> Part:
        """The same part of a stored tensor whose columns each hold `per_column` inputs (a
        quantized weight's packed codes or its block scales); ValueError if it cuts one."""
        if self.dim == 0 or per_column == 1:
            return self
        start, size = self.shard.start, self.shard.size
        if start % per_column or size % per_column:
            raise ValueError(f"inputs [{start}, {start + size}) cut blocks of {per_column}")
        return Part(1, Shard(start // per_column, size // per_column))


@dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name of the logical (dequantized) weight
    shape: tuple[int, ...]  # logical shape as stored, [out, in] for projections
    param: str  # destination parameter of M3ForCausalLM
    index: tuple[int | slice, ...]  # sub-block of the destination (expert, fused rows)
    kind: Kind
    part: Part | None = None  # the slice this rank reads; None: the whole tensor

    @property
    def module(self) -> str:
        """The module name quantization configs use (the tensor name without `.weight`)."""
        return self.name.removesuffix(".weight")


def text_inventory(
    cfg: TextConfig, prefix: str = PREFIX, parallel: Parallel = SINGLE
) -> list[TensorSpec]:
    """Every weight (of this rank, with `parallel`), in a fixed order."""
    table = (cfg.vocab_size, cfg.hidden_size)
    vocab = _rows(parallel.vocab(cfg), parallel)
    specs = [
        _spec(prefix, "model.embed_tokens.weight", table, "table", part=vocab),
        _spec(prefix, "model.norm.weight", (cfg.hidden_size,), "norm"),
        _spec(prefix, "lm_head.weight", table, "table", part=vocab),
    ]
    for layer in range(cfg.num_layers):
        specs.extend(_layer(cfg, layer, prefix, parallel))
    return specs


def _rows(shard: Shard, parallel: Parallel) -> Part | None:
    return Part(0, shard) if parallel.enabled else None


def _inputs(shard: Shard, parallel: Parallel) -> Part | None:
    return Part(1, shard) if parallel.enabled else None


def _spec(
    prefix: str,
    name: str,
    shape: tuple[int, ...],
    kind: Kind,
    param: str | None = None,
    index: tuple[int | slice, ...] = (),
    part: Part | None = None,
) -> TensorSpec:
    return TensorSpec(prefix + name, shape, param or name, index, kind, part)


def _layer(cfg: TextConfig, layer: int, prefix: str, parallel: Parallel) -> Iterator[TensorSpec]:
    base = f"model.layers.{layer}."
    h = cfg.hidden_size
    yield _spec(prefix, base + "input_layernorm.weight", (h,), "norm")
    yield _spec(prefix, base + "post_attention_layernorm.weight", (h,), "norm")
    attn = base + "self_attn."
    sparse = cfg.is_sparse(layer)
    qkv = _fused_rows(attn + "qkv_proj.weight", QKV_PROJECTIONS, qkv_rows(cfg, sparse), h, attn)
    local = _fused_rows(
        attn + "qkv_proj.weight", QKV_PROJECTIONS, qkv_rows(cfg, sparse, parallel), h, attn
    )
    parts = _qkv_parts(cfg, parallel)

    def projection(name: str) -> TensorSpec:
        full_name, shape, kind, fused, _ = qkv[name]
        where = local[name][4]
        return _spec(prefix, full_name, shape, kind, fused, where, _rows(parts[name], parallel))

    yield from map(projection, QKV_PROJECTIONS[:3])
    o_cols = _inputs(parallel.q_heads(cfg).scaled(cfg.head_dim), parallel)
    yield _spec(prefix, attn + "o_proj.weight", (h, cfg.q_size), "linear", part=o_cols)
    yield _spec(prefix, attn + "q_norm.weight", (cfg.head_dim,), "norm")
    yield _spec(prefix, attn + "k_norm.weight", (cfg.head_dim,), "norm")
    if sparse:
        yield from map(projection, QKV_PROJECTIONS[3:])
        yield _spec(prefix, attn + "index_q_norm.weight", (cfg.index_head_dim,), "norm")
        yield _spec(prefix, attn + "index_k_norm.weight", (cfg.index_head_dim,), "norm")
    if cfg.is_moe(layer):
        yield from _moe(cfg, base + "block_sparse_moe.", prefix, parallel)
    else:
        width = cfg.dense_intermediate_size
        yield from _gated_mlp(width, h, base + "mlp.", prefix, parallel.width(width), parallel)


def _qkv_parts(cfg: TextConfig, parallel: Parallel) -> dict[str, Shard]:
    """The rows of each fused projection this rank reads: its heads' (the shared index-K head
    whole)."""
    kv = parallel.kv_heads(cfg).scaled(cfg.head_dim)
    return {
        "q_proj": parallel.q_heads(cfg).scaled(cfg.head_dim),
        "k_proj": kv,
        "v_proj": kv,
        "index_q_proj": parallel.index_heads(cfg).scaled(cfg.index_head_dim),
        "index_k_proj": Shard(0, cfg.index_head_dim),
    }


def _fused_rows(
    fused: str, names: tuple[str, ...], rows: list[int], cols: int, base: str
) -> dict[str, tuple[str, tuple[int, ...], Kind, str, tuple[slice]]]:
    """`_spec` arguments of projections stacked row-wise into the parameter `fused`."""
    specs, start = {}, 0
    for name, count in zip(names, rows, strict=False):
        where = (slice(start, start + count),)
        specs[name] = (f"{base}{name}.weight", (count, cols), "linear", fused, where)
        start += count
    return specs


def _gated_mlp(
    width: int, hidden: int, base: str, prefix: str, shard: Shard, parallel: Parallel
) -> Iterator[TensorSpec]:
    """gate/up (column-parallel: rows `shard`) fused into gate_up_proj, and down_proj
    (row-parallel: inputs `shard`)."""
    fused, n = base + "gate_up_proj.weight", shard.size
    gate_rows, up_rows = (slice(0, n),), (slice(n, 2 * n),)
    rows, cols = _rows(shard, parallel), _inputs(shard, parallel)
    gate, up = (width, hidden), base + "up_proj.weight"
    yield _spec(prefix, base + "gate_proj.weight", gate, "linear", fused, gate_rows, rows)
    yield _spec(prefix, up, gate, "linear", fused, up_rows, rows)
    yield _spec(prefix, base + "down_proj.weight", (hidden, width), "linear", part=cols)


def _moe(cfg: TextConfig, base: str, prefix: str, parallel: Parallel) -> Iterator[TensorSpec]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    yield _spec(prefix, base + "gate.weight", (cfg.num_experts, h), "router")
    yield _spec(prefix, base + "e_score_correction_bias", (cfg.num_experts,), "bias")
    shared, width = base + "shared_experts.", cfg.shared_intermediate_size
    yield from _gated_mlp(width, h, shared, prefix, parallel.width(width), parallel)
    w13, w2 = base + "experts.w13", base + "experts.w2"
    held, slice_ = parallel.experts(cfg), parallel.expert_width(cfg)
    n = slice_.size
    rows, cols = _rows(slice_, parallel), _inputs(slice_, parallel)
    # Only this rank's experts, at their local index; each one's slice of the width.
    for local, e in enumerate(range(held.start, held.stop)):
        expert = f"{base}experts.{e}."
        gate, up = (local, slice(0, n)), (local, slice(n, 2 * n))
        yield _spec(prefix, expert + "w1.weight", (i, h), "linear", w13, gate, rows)
        yield _spec(prefix, expert + "w3.weight", (i, h), "linear", w13, up, rows)
        yield _spec(prefix, expert + "w2.weight", (h, i), "linear", w2, (local,), cols)
