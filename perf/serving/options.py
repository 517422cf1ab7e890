"""perf/bench_serving.py's command line: its flags, their defaults and the checks between them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {
    "concurrency": [1, 16, 64],
    "request_rate": [],
    "num_requests": 64,
    "warmup_requests": 4,
    "input_len": 1024,
    "output_len": 128,
}
SMOKE: dict[str, Any] = {
    "concurrency": [1, 4],
    "request_rate": [32.0],
    "num_requests": 8,
    "warmup_requests": 2,
    "input_len": 32,
    "output_len": 8,
}


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), not {text}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "bench_serving.json" if out else Path("perf/results/bench_serving.json")


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_args(parser)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = parser.add_argument_group("load (defaults in brackets; --smoke changes them)")
    load.add_argument(
        "--concurrency", type=positive, nargs="*", help="closed-loop levels [1 16 64]"
    )
    load.add_argument("--request-rate", type=rate, nargs="*", help="requests/s, Poisson; [none]")
    load.add_argument("--num-requests", type=positive, help="per level [64]")
    load.add_argument("--warmup-requests", type=nonnegative, help="per level, not counted [4]")
    load.add_argument(
        "--decode-probe",
        type=positive,
        metavar="N",
        help="also measure the pure decode step at batch N and the efficiency of concurrency N",
    )
    load.add_argument(
        "--decode-probe-output-len", type=positive, help="its output tokens [4 x output-len]"
    )
    load.add_argument(
        "--prefill-us-per-token",
        type=float,
        help="with --decode-probe: a prompt token's cost (the server's start-up log prints it), "
        "for the ceiling the prompts put on the efficiency",
    )
    load.add_argument(
        "--client-procs",
        type=positive,
        default=1,
        metavar="N",
        help="split each level's workers / arrivals over N client processes [1]",
    )
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds [600]")
    data = parser.add_argument_group("requests")
    data.add_argument("--input-len", type=positive, help="prompt tokens [1024]")
    data.add_argument("--input-len-dist", choices=("fixed", "uniform", "normal"), default="fixed")
    data.add_argument(
        "--input-len-spread", type=float, help="uniform: half-width, normal: std [input-len/4]"
    )
    data.add_argument("--output-len", type=positive, help="max_tokens [128]")
    data.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos"
    )
    data.add_argument(
        "--no-continuous-usage",
        dest="continuous_usage",
        action="store_false",
        help="do not ask for usage in every chunk (stream_options.continuous_usage_stats); "
        "ITL is then per chunk",
    )
    data.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    data.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny fast run (CI): " + str(SMOKE))
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path [{default_out()}]")
    args = parser.parse_args(argv)
    if args.request_rate is not None and args.concurrency is None:
        args.concurrency = []  # open-loop levels asked for: no closed-loop defaults with them
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.decode_probe_output_len is None:
        args.decode_probe_output_len = 4 * args.output_len
    if args.input_len_spread is None:
        args.input_len_spread = args.input_len / 4
    if not args.concurrency and not args.request_rate:
        parser.error("nothing to run: give --concurrency and/or --request-rate levels")
    check_target_args(parser, args)
    if not isinstance(json.loads(args.extra_body), dict):
        parser.error("--extra-body must be a JSON object")
    args.out = args.out or default_out()
    return args


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """The server flags every serving benchmark has: one to run against, or one to start."""
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="a running OpenAI-compatible server; default: start m3serve")
    target.add_argument(
        "--server-args", default="", help="flags for the m3serve serve started here, one string"
    )
    target.add_argument("--model", help="the model name to send; default: the first /v1/models")
    target.add_argument("--api-key", help="sent as a Bearer token")


def check_target_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.url and args.server_args:
        parser.error("--server-args start a server; --url names a running one: pick one")
    server_args = shlex.split(args.server_args)
    if any(a.split("=")[0] in ("--port", "--host") for a in server_args):
        parser.error("the started server listens on a free port of 127.0.0.1: drop --port/--host")
    for i, flag in enumerate(server_args):  # the started server's key is the client's too
        if args.api_key is None and flag == "--api-key" and i + 1 < len(server_args):
            args.api_key = server_args[i + 1]
        elif args.api_key is None and flag.startswith("--api-key="):
            args.api_key = flag.split("=", 1)[1]
