"""Tensor/expert parallel layout without ranks: which heads, rows and experts each rank holds,
the settings that cannot run, and that the loader reads only each rank's slices (loading needs
no collective, so one process can load every rank's share)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from m3serve.backends.reference import ReferenceBackend
from m3serve.kernels.moe import local_expert_ids, moe_experts
from m3serve.model.build import load_model
from m3serve.model.config import TextConfig
from m3serve.model.loader import CheckpointFiles
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.parallel import Parallel, RankGroup, Shard, parallel_problems
from m3serve.model.tiny.checkpoint import TinySpec

REAL = TextConfig()
BF16 = TinySpec(dtype="bfloat16", seed=11)
MIXED = TinySpec(
    dtype="bfloat16", seed=12, quant="modelopt-mixed", num_heads=8,
    dense_intermediate_size=128, intermediate_size=128,
)  # fmt: skip


def layout(tp: int, rank: int, ep: int = 1) -> Parallel:
    return Parallel(RankGroup(rank, tp), ep)


@pytest.mark.parametrize(
    ("tp", "q", "kv", "index"),
    [
        (2, Shard(32, 32), Shard(2, 2), Shard(2, 2)),
        (4, Shard(16, 16), Shard(1, 1), Shard(1, 1)),
        # Each KV head (and its index head) on two ranks: rank 3 reads KV head 1.
        (8, Shard(24, 8), Shard(1, 1), Shard(1, 1)),
    ],
)
def test_real_model_heads_per_rank(tp: int, q: Shard, kv: Shard, index: Shard) -> None:
    rank = 3 if tp == 8 else 1
    p = layout(tp, rank)
    assert (p.q_heads(REAL), p.kv_heads(REAL), p.index_heads(REAL)) == (q, kv, index)
    # Every query head on the rank reads a KV head the rank holds.
    group = REAL.num_heads // REAL.num_kv_heads
    assert {h // group for h in range(q.start, q.stop)} <= set(range(kv.start, kv.stop))


def test_experts_split_by_ep_and_widths_within_each_ep_group() -> None:
    # tp 4, ep 2: ranks 0-1 hold experts 0-63, ranks 2-3 experts 64-127, each half the width.
    p = layout(4, 3, ep=2)
    assert p.experts(REAL) == Shard(64, 64)
    assert p.expert_width(REAL) == Shard(1536, 1536)
    assert layout(4, 3, ep=4).expert_width(REAL) == Shard(0, 3072)
    assert layout(4, 3).experts(REAL) == Shard(0, 128)


def test_real_model_runs_at_tp_2_4_8_with_any_dividing_ep() -> None:
    for tp in (2, 4, 8):
        for ep in (e for e in (1, 2, 4, 8) if tp % e == 0):
            assert parallel_problems(REAL, tp, ep, quantized=True) == []


@pytest.mark.parametrize(
    ("tp", "ep", "quantized", "fragment"),
    [
        (3, 1, False, "attention heads 64 do not split over --tp 3"),
        (3, 1, False, "KV heads 4 can be neither split over nor replicated on --tp 3"),
        (4, 8, False, "--ep 8 must divide --tp 4"),
        (6, 3, False, "--ep 3 does not divide the 128 routed experts"),
        (0, 1, False, "must be >= 1"),
    ],
)
def test_settings_that_cannot_run_are_named(
    tp: int, ep: int, quantized: bool, fragment: str
) -> None:
    assert any(fragment in p for p in parallel_problems(REAL, tp, ep, quantized))


def test_quantized_splits_must_keep_whole_scale_blocks() -> None:
    tiny = BF16.text_model_config().text  # expert width 32: 8 inputs per rank at tp 4
    problems = parallel_problems(tiny, 4, 1, quantized=True)
    assert any(
        "expert width 32 does not split over 4 ranks into multiples of 32" in p for p in problems
    )
    assert parallel_problems(tiny, 4, 1, quantized=False) == []


def test_local_expert_ids_skip_the_experts_held_elsewhere() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen)
    ids = torch.randint(0, 4, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    w13, w2 = torch.randn(4, 10, 8, generator=gen), torch.randn(4, 8, 5, generator=gen)
    whole = moe_experts(x, weights, ids, w13, w2, 1.702, 7.0)
    halves = [
        moe_experts(
            x, weights, local_expert_ids(ids, f, 2), w13[f : f + 2], w2[f : f + 2], 1.702, 7.0
        )
        for f in (0, 2)
    ]
    torch.testing.assert_close(halves[0] + halves[1], whole)


def _load(path: Path, parallel: Parallel, keep: bool) -> M3ForCausalLM:
    backend = ReferenceBackend(torch.device("cpu"), keep_quantized=keep)
    return load_model(path, backend, "float32", progress=False, parallel=parallel).model


@pytest.mark.parametrize(("spec", "keep"), [(BF16, False), (MIXED, False), (MIXED, True)])
def test_each_rank_holds_its_slices_of_the_full_weights(
    tiny_checkpoint: Callable[[TinySpec], Path], spec: TinySpec, keep: bool
) -> None:
    """Stitching the two ranks' weights back together gives the one-rank weights (tp 2; the
    experts by ep 2, the shared expert's width split)."""
    path = tiny_checkpoint(spec)
    full = dict(_load(path, Parallel(), keep).named_parameters())
    ranks = [dict(_load(path, layout(2, r, ep=2), keep).named_parameters()) for r in (0, 1)]
    cfg = spec.text_model_config().text

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([r[name] for r in ranks], dim=dim)

    layer = "model.layers.1."
    assert torch.equal(joined("lm_head.weight", 0), full["lm_head.weight"])
    o_proj = layer + "self_attn.o_proj.weight"
    assert torch.equal(joined(o_proj, 1), full[o_proj])
    experts = layer + "block_sparse_moe.experts.w2"
    assert torch.equal(joined(experts, 0), full[experts])
    down = layer + "block_sparse_moe.shared_experts.down_proj.weight"
    assert torch.equal(joined(down, 1), full[down])
    # q rows of rank 1 are heads 2..3 of 4 (bf16) / 4..7 of 8 (mixed).
    q_rows = cfg.q_size // 2
    qkv = layer + "self_attn.qkv_proj.weight"
    assert torch.equal(ranks[1][qkv][:q_rows], full[qkv][q_rows : 2 * q_rows])
    if keep:  # the MXFP8 scales went with their codes
        scale = layer + "self_attn.o_proj.weight_scale"
        assert torch.equal(joined(scale, 1), full[scale])


def test_a_rank_reads_only_its_slices(
    tiny_checkpoint: Callable[[TinySpec], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint(MIXED)
    read: list[int] = []
    original = CheckpointFiles.tensor

    def counting(self: CheckpointFiles, name: str, part: object = None) -> torch.Tensor:
        tensor = original(self, name, part)  # type: ignore[arg-type]
        if name.startswith("language_model."):  # the small vision tower is read whole by each
            read.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(CheckpointFiles, "tensor", counting)
    _load(path, Parallel(), keep=True)
    whole, read[:] = sum(read), []
    _load(path, layout(4, 2, ep=4), keep=True)
    # A quarter of everything split, plus the replicated norms, router and index-K head.
    assert sum(read) < 0.35 * whole
