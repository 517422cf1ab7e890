"""Tensor and expert parallelism on real ranks (gloo on the CPU, spawned processes): on a bf16
and a ModelOpt mixed-precision tiny checkpoint, --tp 2 and --tp 4 with and without --ep give
the --tp 1 logits of a prompt whose sparse selection drops blocks, and the same greedy tokens
of a short paged decode.

The tiny shapes cover both attention layouts: 2 KV (and index) heads are split at tp 2 and
replicated at tp 4. One spawn per TP size runs every setup, since starting ranks costs most.
The hopper backend's Triton kernels (in the interpreter) get the same check at tp 2 on the
mixed checkpoint: each rank's MXFP8 projections, NVFP4 experts, attention and indexer at its
sliced widths (one KV and one index head, half the expert width).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.ranks import run_on_ranks
from helpers.tp_runs import MIXED, Setup, outputs, rank_outputs

from m3serve.model.tiny.checkpoint import TinySpec

BF16 = TinySpec(dtype="bfloat16", seed=11)
TOLERANCE = 1e-4  # fp32: the ranks' partial sums only reorder the additions


@pytest.fixture(scope="module")
def paths(tiny_checkpoint: Callable[[TinySpec], Path]) -> dict[str, Path]:
    return {"bf16": tiny_checkpoint(BF16), "mixed": tiny_checkpoint(MIXED)}


def setups(paths: dict[str, Path], tp: int) -> list[Setup]:
    """Expert-TP (ep 1), hybrid (ep 2 at tp 4) and pure EP (ep = tp) on both checkpoints, and
    the mixed one with its weights held as stored (the quantized holders' sliced copies)."""
    eps = sorted({1, 2, tp})
    both = [Setup(path, ep) for path in paths.values() for ep in eps]
    return [*both, Setup(paths["mixed"], tp, keep_quantized=True)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_rank(paths: dict[str, Path], tp: int) -> None:
    runs = setups(paths, tp)
    expected = {setup: outputs(Setup(setup.path)) for setup in runs}
    per_rank = run_on_ranks(tp, rank_outputs, runs)
    for rank, results in enumerate(per_rank):
        for setup, (logits, tokens) in zip(runs, results, strict=True):
            want_logits, want_tokens = expected[setup]
            where = f"rank {rank} of tp {tp}, {setup.path.name} ep {setup.ep}"
            assert logits.shape == want_logits.shape, where
            delta = (logits - want_logits).abs().max().item()
            assert delta <= TOLERANCE, f"{where}: logits differ by {delta}"
            assert tokens == want_tokens, where


@pytest.mark.slow
def test_the_hopper_kernels_at_tp_2_equal_one_rank(paths: dict[str, Path]) -> None:
    # Three decode steps run every decode kernel at a growing length; more only repeat them.
    setup = Setup(paths["mixed"], hopper=True, decode_tokens=3)
    want_logits, want_tokens = outputs(setup)
    for rank, [(logits, tokens)] in enumerate(run_on_ranks(2, rank_outputs, [setup])):
        delta = (logits - want_logits).abs().max().item()
        assert delta <= TOLERANCE, f"rank {rank}: logits differ by {delta}"
        assert tokens == want_tokens, f"rank {rank}"
