"""--tp 2 on two GPUs, through the Engine as `m3serve serve --tp 2` runs it (the launcher spawns
a follower engine process; NCCL between the GPUs, a gloo group for the step plans): the
warm-up, the decode CUDA graphs (their all-reduces captured) and the step-cost timing run in
step on both ranks, and the greedy tokens equal --tp 1's; with --ep 2 too, and on the ModelOpt
mixed checkpoint (weights held quantized, each rank its slices). HiCache under --tp 2: each
rank's pinned part of the host pool, the follower's copies of rank 0's backups on its side
stream, and L3 (a second --tp 2 server fetches the prefix). Skipped below two GPUs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.greedy import GREEDY, first_divergence
from helpers.hf_oracle import random_prompt
from helpers.hicache_workload import GREEDY as HICACHE_GREEDY
from helpers.hicache_workload import PREFIX, SMALL_POOL
from helpers.hicache_workload import PROMPTS as HICACHE_PROMPTS
from helpers.tp_runs import MIXED

from m3serve import Engine
from m3serve.model.tiny.checkpoint import TinySpec

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

SPECS = {
    "bf16": TinySpec(dtype="bfloat16", seed=1),
    "mixed": MIXED,  # whole scale blocks of 32 on each rank
}
PROMPTS = [random_prompt(s, 20 + 9 * s, SPECS["bf16"].vocab_size - 64) for s in range(1, 5)]
# Small limits keep the warm-up (which runs here: it is what must run in step) short.
ARGS = {"backend": "hopper", "context_length": 1024, "max_total_tokens": 16384}
MATCHING_PREFIX = 8  # bf16: tokens that must agree before reordered sums may drift


@pytest.fixture(scope="module")
def paths(tiny_checkpoint: Callable[[TinySpec], Path]) -> dict[str, Path]:
    return {name: tiny_checkpoint(spec) for name, spec in SPECS.items()}


def greedy(path: Path, **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    with Engine(str(path), **ARGS, **kwargs) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        info = engine.server_info
    return [r["output_ids"] for r in results], info


@pytest.mark.parametrize(
    ("name", "dtype", "ep", "graphs"),
    [
        ("bf16", "float32", 1, False),  # fp32 runs eager on the hopper backend (its own tests)
        ("bf16", "bfloat16", 2, True),
        ("mixed", "bfloat16", 1, True),
    ],
)
def test_tp_2_gives_tp_1_greedy_tokens(
    paths: dict[str, Path], name: str, dtype: str, ep: int, graphs: bool
) -> None:
    kwargs = {"dtype": dtype, "disable_cuda_graph": not graphs}
    want, _ = greedy(paths[name], **kwargs)
    got, info = greedy(paths[name], tp_size=2, ep_size=ep, **kwargs)
    assert info["tp_size"] == 2
    assert bool(info["cuda_graph_bs"]) == graphs, "the decode graphs were not captured"
    # fp32: the ranks' partial sums only reorder additions, so every token agrees.
    length = None if dtype == "float32" else MATCHING_PREFIX
    got, want = [g[:length] for g in got], [w[:length] for w in want]
    assert got == want, [first_divergence(g, w) for g, w in zip(got, want, strict=True)]


def hicache_run(path: Path, **kwargs: Any) -> list[dict[str, Any]]:
    args = {"device": "cuda", "dtype": "float32", "skip_warmup": True, **kwargs}
    with Engine(str(path), **args) as engine:
        return [
            engine.generate(input_ids=p, sampling_params=HICACHE_GREEDY) for p in HICACHE_PROMPTS
        ]


def test_tp_2_hicache_brings_a_prefix_back_from_host_and_l3(
    paths: dict[str, Path], tmp_path: Path
) -> None:
    path = paths["bf16"]
    want = [o["output_ids"] for o in hicache_run(path)]
    small = {
        "tp_size": 2,
        "max_total_tokens": SMALL_POOL,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "l3"),
    }
    first = hicache_run(path, **small)
    assert [o["output_ids"] for o in first] == want
    assert first[-1]["meta_info"]["cached_tokens"] == len(PREFIX)  # from the host pools
    replica = hicache_run(path, **small)  # a new server: empty host pools, the same L3 files
    assert [o["output_ids"] for o in replica] == want
    # Every prompt finds at least the prefix's pages in L3 (on the CPU: 40, 40, 40, 44, 44).
    assert min(o["meta_info"]["cached_tokens"] for o in replica) >= len(PREFIX)
