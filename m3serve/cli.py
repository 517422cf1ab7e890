"""The `m3serve` command line: `serve`, `generate` and `make-tiny`.

Flags come from the typed config sections; names follow SGLang's where SGLang has the setting.
A refused setting, a missing model or a port in use is one line on stderr and exit code 2; an
engine that died is exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from m3serve import __version__
from m3serve.engine.async_engine import EngineDeadError
from m3serve.model.locate import ModelNotFound
from m3serve.runtime.config import ConfigInvalid, ServerArgs
from m3serve.runtime.options import add_section, section_from_args

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C


class DefaultsShown(argparse.HelpFormatter):
    """Help that shows each flag's default, unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3serve", description="MiniMax-M3.1 inference server")
    parser.add_argument("--version", action="version", version=f"m3serve {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", formatter_class=DefaultsShown
    )
    ServerArgs.add_arguments(serve)

    gen = commands.add_parser(
        "generate",
        help="generate text from a prompt through the engine",
        formatter_class=DefaultsShown,
    )
    gen.add_argument("prompt", nargs="?", default="The capital of France is")
    ServerArgs.add_arguments(gen)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=32)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    from m3serve.model.tiny.checkpoint import TinySpec

    tiny = commands.add_parser("make-tiny", help="write a tiny random M3.1 checkpoint")
    tiny.add_argument("out_dir", type=Path)
    add_section(tiny, TinySpec)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            return _generate(args)
        return _make_tiny(args)
    except EngineDeadError as exc:
        print(f"m3serve: error: {exc}", file=sys.stderr)
        return 1
    except (ConfigInvalid, ModelNotFound, ValueError, RuntimeError) as exc:
        print(f"m3serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return INTERRUPTED


def _serve(args: argparse.Namespace) -> int:
    from m3serve.api.server import serve

    return serve(ServerArgs.from_args(args))


def _make_tiny(args: argparse.Namespace) -> int:
    from m3serve.model.tiny.checkpoint import TinySpec, make_tiny

    spec = section_from_args(TinySpec, args)
    out = make_tiny(args.out_dir, spec)
    print(f"wrote tiny checkpoint to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from m3serve.engine.offline import Engine

    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
    }
    started = time.monotonic()
    with Engine(server_args=ServerArgs.from_args(args)) as engine:
        ready = time.monotonic()
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            chunks = engine.chat(messages, sampling_params=sampling, stream=True)
        else:
            print(args.prompt, end="", flush=True)
            chunks = engine.generate(args.prompt, sampling, stream=True)
        meta: dict = {}
        for chunk in chunks:
            print(chunk["text"], end="", flush=True)
            meta = chunk["meta_info"]
        print()
        elapsed = time.monotonic() - ready
        info = engine.server_info
    print(
        f"[{meta.get('prompt_tokens', 0)} prompt + {meta.get('completion_tokens', 0)} new tokens "
        f"in {elapsed:.2f}s ({meta.get('completion_tokens', 0) / max(elapsed, 1e-9):.1f} tok/s), "
        f"start-up {ready - started:.1f}s, backend {info.get('backend')}, "
        f"{info.get('dtype')} on {info.get('device')}]",
        file=sys.stderr,
    )
    return 0
