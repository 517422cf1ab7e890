"""The command line as users run it: real subprocesses of `python -m m3serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from m3serve.cli import build_parser


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "m3serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_make_tiny_then_generate_prints_text(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    made = run_cli("make-tiny", str(out), "--num-layers", "2", "--num-experts", "4", "--seed", "5")
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2
    assert config["text_config"]["num_local_experts"] == 4
    gen = run_cli("generate", "--model-path", str(out), "Hello", "--max-new-tokens", "6")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("Hello")
    assert "new tokens" in gen.stderr and "backend reference" in gen.stderr


def test_generate_without_model_path_uses_the_built_in_checkpoint(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    gen = run_cli("generate", "--max-new-tokens", "4", "--chat", "hi", env=env)
    assert gen.returncode == 0, gen.stderr
    built_in = list((tmp_path / "m3serve").glob("tiny-m3.1-*/config.json"))
    assert len(built_in) == 1


def test_greedy_generate_is_deterministic(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first = run_cli("generate", "abc", "--max-new-tokens", "8", env=env)
    second = run_cli("generate", "abc", "--max-new-tokens", "8", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_a_backend_that_cannot_run_here_refuses_with_a_clear_message(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    gen = run_cli("generate", "--backend", "blackwell", env=env)
    assert gen.returncode == 2
    assert "backend 'blackwell' is not built yet" in gen.stderr
    gen = run_cli("generate", "--backend", "hopper", "--device", "cpu", env=env)
    assert gen.returncode == 2
    assert "backend 'hopper' needs a CUDA device" in gen.stderr


def test_make_tiny_flags_come_from_the_spec_fields() -> None:
    args = build_parser().parse_args(
        ["make-tiny", "x", "--quant", "modelopt-mixed", "--shards", "3", "--dtype", "float32"]
    )
    assert (args.quant, args.shards, args.dtype) == ("modelopt-mixed", 3, "float32")
