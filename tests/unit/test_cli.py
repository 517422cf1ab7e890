"""The command line as users run it: real subprocesses of `python -m m3serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import m3serve
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


def test_version_prints_the_package_version() -> None:
    shown = run_cli("--version")
    assert shown.returncode == 0
    assert shown.stdout.strip() == f"m3serve {m3serve.__version__}"


def help_entry(text: str, flag: str) -> str:
    """One flag's entry in the option list of a --help text."""
    start = text.index(f"\n  {flag} ") + 3
    return text[start:].split("\n  --")[0]


def test_serve_help_groups_flags_by_section_and_lists_unbuilt_ones_apart() -> None:
    shown = run_cli("serve", "--help")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    titles = ["model:", "KV cache:", "scheduling:", "runtime:", "HTTP API:", "kernels:"]
    at = [text.index(f"\n{title}\n") for title in [*titles, "not built yet:"]]
    assert at == sorted(at)  # every built section comes before the unbuilt flags
    built, unbuilt = text[: at[-1]], text[at[-1] :]
    for flag in ("--speculative-draft-kv-cache-dtype", "--monokernel-backend"):
        assert flag in unbuilt and f"[{flag}" in built  # listed apart; the usage line has all
    assert "--speculative-algorithm" not in unbuilt  # DSpark is built
    assert "--disable-cuda-graph" not in unbuilt  # a kernel flag this build honours
    assert "--tp" not in unbuilt and "--ep" not in unbuilt  # engine ranks are built
    assert "--enable-hierarchical-cache" not in unbuilt  # HiCache is built
    assert "--cuda-graph-backend-prefill" not in unbuilt
    assert "(default: 30000)" in help_entry(built, "--port")
    assert "(default: 30.0)" in help_entry(built, "--graceful-shutdown-timeout")


def test_a_missing_model_path_is_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    for command in ("serve", "generate"):
        run = run_cli("--log-level", "warning", command, "--model-path", missing)
        assert run.returncode == 2, run.stderr
        assert run.stderr.splitlines() == [run.stderr.strip()]
        assert run.stderr.startswith(f"m3serve: error: model {missing!r} is not a local directory")


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model path is missing too: the port error comes first, before any model work.
        flags = ["--port", str(port), "--model-path", str(tmp_path / "no-such-model")]
        run = run_cli("--log-level", "warning", "serve", *flags)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (
        f"m3serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
