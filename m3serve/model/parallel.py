"""Tensor and expert parallelism of the model over one group of ranks (`torch.distributed`:
NCCL on GPUs, gloo on the CPU).

Every rank holds a slice of each large weight and runs the same step on the same batch; the
ranks meet in one all-reduce per attention and per feed-forward block, one for the embedding
and one all-gather for the logits. With one rank nothing here communicates, and the model runs
exactly its single-device code path.

Attention: the query heads are split (64 / tp per rank). The KV heads (4) and the indexer's
query heads (4, one per KV group) are split when tp divides their count and replicated when
their count divides tp, so each rank holds the KV head (and the index head) its query heads
read. The indexer's single shared index-K head is replicated on every rank (128 rows of
weights and 128 values per token: cheaper than a collective). `o_proj` is row-parallel.

    tp | q heads | KV heads          | index-q heads     | index-K head
    1  | 64      | 4                 | 4                 | 1
    2  | 32      | 2 (split)         | 2 (split)         | 1 (replicated)
    4  | 16      | 1 (split)         | 1 (split)         | 1 (replicated)
    8  | 8       | 1 (each on 2 ranks) | 1 (each on 2 ranks) | 1 (replicated)

At tp 8 a KV head's cache is held by the two ranks whose queries read it (KV memory per rank is
1/4 of the total, not 1/8), and both compute its block selection.

Feed-forward: the dense MLP and the shared expert are column-parallel (gate/up rows split) then
row-parallel (down_proj columns split). The routed experts run `--ep` expert-parallel groups of
tp / ep ranks: group g holds experts [g E/ep, (g+1) E/ep), each expert's intermediate split
over the group's ranks (ep = tp: whole experts; ep = 1: every expert on every rank, split).
The router is replicated: each rank routes every token and computes only its experts' share;
the routed and shared partial sums meet in the block's single all-reduce (no all-to-all yet).

Vocabulary: the embedding and the LM head are split by rows (vocab / tp). The embedding
all-reduces (each token's row comes from the one rank that holds it, zeros elsewhere); the
logits are all-gathered, so every rank samples from the full distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from m3serve.model.config import TextConfig

# Every quantized format's scale block divides this (MXFP8: 32 inputs, NVFP4: 16): a weight
# split along its inputs keeps whole scale blocks on each rank when the slice is a multiple.
QUANT_ALIGN = 32


@dataclass(frozen=True)
class Shard:
    """The part [start, start + size) of one weight dimension that a rank holds."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def scaled(self, factor: int) -> Shard:
        """The same part in units `factor` times smaller (heads -> rows of `factor` each)."""
        return Shard(self.start * factor, self.size * factor)


def split(total: int, parts: int, index: int) -> Shard:
    if total % parts:
        raise ValueError(f"{total} does not split into {parts} equal parts")
    size = total // parts
    return Shard(index * size, size)


def split_or_replicate(total: int, parts: int, index: int) -> Shard:
    """An exact split when `parts` divides `total`; else (`total` divides `parts`) one item per
    rank, each item on parts / total consecutive ranks."""
    if total % parts == 0:
        return split(total, parts, index)
    if parts % total:
        raise ValueError(f"{total} heads can be neither split over nor replicated on {parts}")
    return Shard(index // (parts // total), 1)


# One output tensor for the gathered parts: a single collective that a CUDA graph captures
# (the list form allocates and copies on the communicator's stream). torch 2.13 renamed it.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the tensor-parallel group. `group` None: the default group.

    `host_group` carries what the host sends and reads (step plans, sampled token ids) as CPU
    tensors: on GPUs a gloo group beside the NCCL one, so a follower learns its next plan without
    waiting for its device queue to drain (a broadcast on an NCCL stream, then `.item()`, would
    sync with every kernel queued before it). None: `group` (on the CPU both are gloo)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    host_group: Any = None

    @property
    def host(self) -> Any:
        return self.group if self.host_group is None else self.host_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (x itself with one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        # The parts land one after another along dim 0 (the form gloo takes too).
        parts = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        _gather_into(parts, x.contiguous(), group=self.group)
        return torch.cat(parts.chunk(self.size), dim=dim)


@dataclass(frozen=True)
class Parallel:
    """How the model is spread over `ranks`: which slice of each weight this rank holds."""

    ranks: RankGroup = RankGroup()
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.ranks.size % self.ep_size:
            raise ValueError(f"--ep {self.ep_size} must divide --tp {self.ranks.size}")

    @property
    def enabled(self) -> bool:
        return self.ranks.size > 1

    @property
    def moe_tp_size(self) -> int:
        """Ranks sharing each expert (its intermediate split over them)."""
        return self.ranks.size // self.ep_size

    def q_heads(self, cfg: TextConfig) -> Shard:
        return split(cfg.num_heads, self.ranks.size, self.ranks.rank)

    def kv_heads(self, cfg: TextConfig) -> Shard:
        return split_or_replicate(cfg.num_kv_heads, self.ranks.size, self.ranks.rank)

    def index_heads(self, cfg: TextConfig) -> Shard:
        return split_or_replicate(cfg.index_n_heads, self.ranks.size, self.ranks.rank)

    def vocab(self, cfg: TextConfig) -> Shard:
        return split(cfg.vocab_size, self.ranks.size, self.ranks.rank)

    def width(self, total: int) -> Shard:
        """The dense MLP's or the shared expert's intermediate slice."""
        return split(total, self.ranks.size, self.ranks.rank)

    def experts(self, cfg: TextConfig) -> Shard:
        return split(cfg.num_experts, self.ep_size, self.ranks.rank // self.moe_tp_size)

    def expert_width(self, cfg: TextConfig) -> Shard:
        moe_tp = self.moe_tp_size
        return split(cfg.intermediate_size, moe_tp, self.ranks.rank % moe_tp)


SINGLE = Parallel()


def vocab_parallel_embed(
    table: torch.Tensor, ids: torch.Tensor, vocab: Shard, ranks: RankGroup
) -> torch.Tensor:
    """Rows of the full embedding for `ids`, from a table holding rows `vocab` only: each
    rank looks up the ids it holds, zeros for the others, and the ranks sum (exact)."""
    local = ids - vocab.start
    inside = (local >= 0) & (local < vocab.size)
    rows = table[local.clamp(0, vocab.size - 1)].masked_fill(~inside[:, None], 0)
    return ranks.all_reduce(rows)


def parallel_problems(cfg: TextConfig, tp: int, ep: int, quantized: bool) -> list[str]:
    """Why `--tp tp --ep ep` cannot run this model (empty when it can): every reason at once."""
    if tp < 1 or ep < 1:
        return [f"--tp {tp} and --ep {ep} must be >= 1"]
    if ep > tp or tp % ep:
        return [f"--ep {ep} must divide --tp {tp} (experts are split within the TP ranks)"]
    problems = [
        f"{what} {count} do not split over --tp {tp}"
        for what, count in (("attention heads", cfg.num_heads), ("vocab rows", cfg.vocab_size))
        if count % tp
    ]
    for what, count in (("KV heads", cfg.num_kv_heads), ("index heads", cfg.index_n_heads)):
        if count % tp and tp % count:
            problems.append(f"{what} {count} can be neither split over nor replicated on --tp {tp}")
    if cfg.num_experts % ep:
        problems.append(f"--ep {ep} does not divide the {cfg.num_experts} routed experts")
    widths = {
        "dense MLP width": (cfg.dense_intermediate_size, tp),
        "shared expert width": (cfg.shared_intermediate_size, tp),
        "expert width": (cfg.intermediate_size, tp // ep),
        "attention output width": (cfg.q_size, tp),
    }
    align = QUANT_ALIGN if quantized else 1
    for what, (total, parts) in widths.items():
        if total % (parts * align):
            blocks = f" into multiples of {align} (quantized scale blocks)" if quantized else ""
            problems.append(f"{what} {total} does not split over {parts} ranks{blocks}")
    return problems
