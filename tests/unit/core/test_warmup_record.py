"""The warm-up record: a restart runs only the plans that brought in a kernel variant."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from helpers.kernel_classes import KernelClasses

from m3serve.core.engine_start import warm_up
from m3serve.core.memory import KVBudget
from m3serve.core.warmup_record import Recorder, WarmupRecord, record_key
from m3serve.model.config import TextConfig
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import StepPlan


def test_a_record_gives_back_the_plans_it_saved(tmp_path: Path) -> None:
    record = WarmupRecord(tmp_path / "warmup", "k1")
    assert record.load() is None  # none yet: the whole pass runs
    record.save(100, [0, 7, 42])
    assert record.load() == {0, 7, 42}
    assert json.loads(record.path.read_text())["plans"] == 100
    assert list(record.path.parent.iterdir()) == [record.path]  # no partial file left


def test_a_malformed_record_or_another_keys_gives_none(tmp_path: Path) -> None:
    record = WarmupRecord(tmp_path, "k1")
    for body in ("{not json", '{"key": "k1", "loaded": "all"}', "[1, 2]"):
        record.path.write_text(body)
        assert record.load() is None
    record.path.write_text(json.dumps({"key": "k2", "plans": 3, "loaded": [1]}))
    assert record.load() is None


def test_a_record_that_cannot_be_written_is_skipped(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    record = WarmupRecord(blocker / "warmup", "k1")  # under a file: no directory can be made
    record.save(3, [1])
    assert record.load() is None


@dataclass(frozen=True)
class _Part:
    formats: frozenset[str]
    sizes: tuple[int, ...] = (1, 2)


def test_the_key_follows_every_part_but_not_the_order_of_a_set() -> None:
    key = record_key({"a": _Part(frozenset({"MXFP8", "NVFP4"})), "b": 1})
    assert key == record_key({"b": 1, "a": _Part(frozenset({"NVFP4", "MXFP8"}))})
    assert key != record_key({"a": _Part(frozenset({"MXFP8"})), "b": 1})
    assert key != record_key({"a": _Part(frozenset({"MXFP8", "NVFP4"}), (1, 3)), "b": 1})
    assert key != record_key({"a": _Part(frozenset({"MXFP8", "NVFP4"})), "b": 2})


def _start(tmp_path: Path, num_pages: int = 64, **kwargs: Any) -> tuple[Any, KernelClasses]:
    """A start of a server process as the warm-up sees it (each plan's kernels a class, brought
    in by the first plan that needs it)."""
    process = KernelClasses()

    def run(plan: StepPlan, layers: list[int]) -> None:
        # The engine's slot page table holds the pool's pages: no plan may need more.
        assert all(seq.num_pages <= num_pages for seq in plan.seqs)
        process.see(plan)

    runner: Any = SimpleNamespace(
        model=SimpleNamespace(cfg=TextConfig(num_layers=2, layer_types=("sparse",) * 2,
                                             mlp_layer_types=("dense", "moe"))),
        run=run,
        sampler=SimpleNamespace(warm_up=lambda: None),
    )  # fmt: skip
    args = ServerArgs.from_kwargs(max_running_requests=4, chunked_prefill_size=64, **kwargs)
    recorder = Recorder(tmp_path, {"model": "tiny"}, process.count)
    done = warm_up(args, runner, KVBudget(num_pages, page_size=16), None, 256, 4, recorder)
    return done, process


def test_a_restart_runs_only_the_plans_that_brought_in_a_kernel(tmp_path: Path) -> None:
    first, cold = _start(tmp_path)
    assert not first.recorded and first.steps == first.plans == cold.plans
    again, warm = _start(tmp_path)
    assert again.recorded and again.plans == first.plans
    assert again.steps == len(cold.loaded) < first.plans  # one plan a kernel class
    assert warm.loaded == cold.loaded  # and every class the whole pass brought in
    full, forced = _start(tmp_path, full_warmup=True)
    assert not full.recorded and forced.plans == first.plans
    assert forced.loaded == cold.loaded


def test_a_pool_of_another_size_reuses_the_record(tmp_path: Path) -> None:
    # 64 and 61 pages of 16 hold the 256-token context: one pass, one record.
    first, _ = _start(tmp_path)
    assert _start(tmp_path, num_pages=61)[0].recorded
    # 6 pages do not: the pass stops at the pool's 96 tokens (no request is longer), and its
    # record is that pool's.
    capped, _ = _start(tmp_path, num_pages=6)
    assert not capped.recorded and capped.plans < first.plans
    again, _ = _start(tmp_path, num_pages=6)
    assert again.recorded and again.plans == capped.plans
