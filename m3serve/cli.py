"""The `m3serve` command line: `generate` and `make-tiny` (the server arrives with `serve`).

Flags come from the typed config sections; names follow SGLang's where SGLang has the setting.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from m3serve.runtime.config import (
    BackendArgs,
    ConfigInvalid,
    ModelArgs,
    add_section,
    section_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3serve", description="MiniMax-M3.1 inference server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt in-process")
    gen.add_argument("prompt", nargs="?", default="The capital of France is")
    add_section(gen, ModelArgs)
    add_section(gen, BackendArgs)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--ignore-eos", action="store_true")

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
        if args.command == "generate":
            return _generate(args)
        return _make_tiny(args)
    except (ConfigInvalid, ValueError, RuntimeError) as exc:
        print(f"m3serve: error: {exc}", file=sys.stderr)
        return 2


def _make_tiny(args: argparse.Namespace) -> int:
    from m3serve.model.tiny.checkpoint import TinySpec, make_tiny

    spec = section_from_args(TinySpec, args)
    out = make_tiny(args.out_dir, spec)
    print(f"wrote tiny checkpoint to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch
    from tokenizers import Tokenizer

    from m3serve.kernels.sampling import SamplingConfig
    from m3serve.model.build import load_model
    from m3serve.model.chat_template import load_chat_template, render_chat
    from m3serve.model.generate import stream_tokens

    model_args = section_from_args(ModelArgs, args)
    backend_args = section_from_args(BackendArgs, args)
    loaded = load_model(
        model_args.model_path, backend_args.backend, model_args.dtype, backend_args.device
    )
    tokenizer = Tokenizer.from_file(str(loaded.path / "tokenizer.json"))
    prompt = args.prompt
    if args.chat:
        template = load_chat_template(loaded.path)
        if template is None:
            raise ValueError(f"--chat: no chat template in {loaded.path}")
        prompt = render_chat(template, [{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p)
    started = time.monotonic()
    stop = () if args.ignore_eos else None
    with torch.inference_mode():
        out = list(stream_tokens(loaded.model, ids, args.max_new_tokens, sampling, args.seed, stop))
    elapsed = time.monotonic() - started
    completion = tokenizer.decode(out, skip_special_tokens=True)
    print(completion if args.chat else prompt + completion)
    print(
        f"[{len(ids)} prompt + {len(out)} new tokens in {elapsed:.2f}s, "
        f"{len(out) / max(elapsed, 1e-9):.1f} tok/s, backend {loaded.backend.name}, "
        f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device}]",
        file=sys.stderr,
    )
    return 0
