"""perf/bench_mixed_step.py on the built-in tiny checkpoint (CPU): every batch gets its pure
decode step and one mixed step per chunk, and the fit's fixed cost is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from bench_mixed_step import host_ms_without_replay, kernel_us, print_kernel_diff

from m3serve.kernels.triton.launches import LayerCalls
from m3serve.model.tiny.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_run_writes_a_row_per_batch_and_chunk(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    command = [
        sys.executable, "perf/bench_mixed_step.py", "--model-path", str(default_model_path()),
        "--batches", "1", "3", "--chunks", "8", "16", "--context", "12", "--top", "3",
        "--out", str(out), "--traces", "--no-mxfp8-bf16-copy",
    ]  # fmt: skip
    run = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [(r["batch"], r["chunk"]) for r in report["rows"]] == [
        (b, c) for b in (1, 3) for c in (0, 8, 16)
    ]
    assert all(r["wall_ms"] > 0 and r["host_ms"] > 0 for r in report["rows"])
    assert all("fixed_ms" in r for r in report["rows"] if r["chunk"])
    assert report["prefill_ms_per_token"] > 0
    assert not report["mxfp8_bf16_copy"]  # the server's --no- form (moot on the CPU)
    # The reference backend replays no layer launches: no ablation column to fill.
    assert all(r["host_ms_no_replay"] is None for r in report["rows"])
    assert "fixed cost per mixed step" in run.stdout and "top ops" in run.stdout
    for name in ("decode", "mixed"):  # the middle batch's two steps, for chrome://tracing
        events = json.loads((tmp_path / f"trace_{name}.json").read_text())["traceEvents"]
        assert any(e.get("dur", 0) > 0 for e in events)  # timed, not cleared by a later profile


def test_the_kernel_diff_sums_each_kernels_time_per_step(capsys: Any) -> None:
    def prof(*kernels: tuple[str, float]) -> SimpleNamespace:
        cuda = torch.autograd.DeviceType.CUDA
        events = [
            SimpleNamespace(
                name=name, device_type=cuda, time_range=SimpleNamespace(elapsed_us=lambda us=us: us)
            )
            for name, us in kernels
        ]
        cpu = SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU)
        return SimpleNamespace(events=lambda: [*events, cpu])

    decode = prof(("gemm", 10.0), ("gemm", 10.0), ("norm", 2.0))
    mixed = prof(("gemm", 15.0), ("gemm", 15.0), ("norm", 2.0), ("attn_prefill", 7.0))
    assert kernel_us(mixed) == {"gemm": (30.0, 2), "norm": (2.0, 1), "attn_prefill": (7.0, 1)}
    print_kernel_diff(decode, mixed, top=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["gemm", "20.0", "2", "30.0", "2", "+10.0"]  # the biggest first
    assert lines[2].split() == ["attn_prefill", "0.0", "0", "7.0", "1", "+7.0"]
    assert lines[-1].split()[-1] == "+17.0"  # every kernel, not only the top ones


def test_the_no_replay_ablation_launches_every_layer_then_replays_again() -> None:
    calls = LayerCalls()
    runner = SimpleNamespace(model=SimpleNamespace(backend=SimpleNamespace(layer_calls=calls)))
    seen: list[bool] = []
    ms = host_ms_without_replay(runner, lambda: seen.append(calls.replay), lambda: None)  # type: ignore[arg-type]
    assert ms is not None and ms >= 0
    assert seen and not any(seen) and calls.replay
