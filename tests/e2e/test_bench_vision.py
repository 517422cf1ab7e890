"""perf/bench_vision.py: its FLOP count (the floor's numerator) equals what torch's flop counter
sees in the encoder's forward (attention apart), and a one-layer run on this CPU writes its
table's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
from bench_vision import encoder_flops, random_encoder
from torch.utils.flop_counter import FlopCounterMode

from m3serve.model.vision.config import VisionConfig

ROOT = Path(__file__).resolve().parents[2]


def test_flop_count_matches_torchs_counter() -> None:
    cfg = replace(
        VisionConfig(),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        text_hidden_size=48,
        projector_hidden_size=40,
    )
    encoder = random_encoder(cfg, torch.device("cpu"), torch.float32)
    grid = (1, 6, 8)
    pixels = torch.randn(48, cfg.patch_dim)
    with FlopCounterMode(display=False) as counter:
        encoder.encode(pixels, [grid])
    # The counter sees the matmuls but not CPU SDPA's fused math: compare without attention.
    # (The biased projections are addmm: the bias rides in the matmul.)
    assert counter.get_flop_counts()["Global"].keys() <= {torch.ops.aten.mm, torch.ops.aten.addmm}
    assert counter.get_total_flops() == encoder_flops(cfg, 48, attention=False)
    attention = encoder_flops(cfg, 48) - encoder_flops(cfg, 48, attention=False)
    assert attention == cfg.num_layers * 2 * (2 * 48 * 48 * cfg.hidden_size)  # QK^T and PV


def test_one_layer_run_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "vision.json"
    run = subprocess.run(
        [
            sys.executable,
            "perf/bench_vision.py",
            "--layers",
            "1",
            "--sides",
            "56",
            "112",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [4, 16]  # (56/28)^2, (112/28)^2
    for row in report["rows"]:
        assert row["us_per_image"] > 0 and row["floor_us"] > 0
    assert "of floor" in run.stdout
