"""Agentic multi-turn benchmark: a synthetic trace with the AgentX shape (sessions of many turns,
each resending the conversation so far plus ~2% new tokens; serving/trace.py) replayed against
an OpenAI-compatible /v1/chat/completions, by default an `m3serve serve` started here.

    # 4 and 16 concurrent sessions of 8 turns, ~4K-token system prompts, ~256-token answers
    python perf/bench_agentic.py --sessions 4,16
    python perf/bench_agentic.py --server-args "--model-path /ckpt --enable-hierarchical-cache" \\
        --sessions 32,64 --turns 20 --initial-tokens 20000 --output-tokens 500 --num-gpus 1
    # server variants in one run: HiCache off / host pool 2x / 4x a small device pool
    python perf/bench_agentic.py --server-args "--max-total-tokens 8192" --variant off= \
        --variant ratio2="--enable-hierarchical-cache --hicache-ratio 2" \
        --variant ratio4="--enable-hierarchical-cache --hicache-ratio 4"
    # what CI runs (tests/e2e/test_bench_agentic.py): tiny model, 2 and 4 sessions of 3 turns
    python perf/bench_agentic.py --smoke --out /tmp/bench_agentic.json

Load. Each `--sessions N` level replays N sessions at once (N lanes, AgentX's notion of
concurrency): each session sends its turns one after another, turn k+1 as soon as turn k's
answer has streamed (plus a think time if `--think-time` is set), as a real multi-turn chat —
system prompt, then user / assistant messages with the answers the server gave — so that the
server's prefix cache can serve the resent conversation. Every level gets its own sessions
(seeded by `--seed` and the level), so no level's cache serves another's. Requests are streamed
with `max_tokens` = the turn's output size, `ignore_eos`, and `stream_options` include_usage +
continuous_usage_stats. `--warmup-requests` short single-turn requests go first, not counted.

Metrics per level (client perf_counter stamps; T = the level's wall time; TTFT, ITL, TPOT as in
perf/bench_serving.py, ITL per token where the server sends per-chunk usage):
    throughput per GPU = (sum usage.prompt_tokens, cached ones included, + sum
                          usage.completion_tokens) / T / --num-gpus
    TTFT p50/p90 (also for first turns and later turns apart), ITL p50/p90
    per-user speed     = 1 / ITL p90 (tokens/s one user sees at the slow end)
    prefix cache hit   = sum usage.prompt_tokens_details.cached_tokens / sum prompt tokens
                         (n/a if the server sends no cached_tokens)
    ideal session hit  = what a prefix cache could serve from the same session: of each later
                         turn's prompt, the previous turn's prompt + answer (the real rate can
                         be higher: every request shares the chat template's opening tokens)
    /metrics           = differences over the level of m3serve:prompt_tokens_total,
                         m3serve:cached_prompt_tokens_total (else m3serve:cached_tokens_total)
                         and m3serve:hicache_host_hit_tokens_total; the HiCache hit rate is the
                         host hits over the server's prompt tokens (n/a where absent)

Variants (serving/variants.py). Each `--variant NAME="serve flags"` is an m3serve serve with
the common --server-args plus its flags, started in its turn, given the same seeded trace (the
same sessions and texts at every level) and stopped. The JSON then has `variants` (each with its
server args, levels and log tail) and `table`, one row per (variant, sessions); the PNG has one
line per variant. A variant whose server fails is reported and the others still run (exit 1).

Output: a table per level and a summary; JSON at --out (default perf/results/bench_agentic.json,
or $OUT/bench_agentic.json) with the trace's parameters, every level's metrics and per-turn
records; a PNG next to it (throughput per GPU and per-user speed against sessions) when
matplotlib is installed. `--trace-out DIR` also writes each level's trace as Weka JSON files
(DIR/sessionsN/<session>.json), which aiperf replays with `--input-file DIR/sessionsN
--custom-dataset-type weka_trace` (perf/results/crosscheck_cpu.md).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from serving.agentic import replay, session_texts
from serving.agentic_report import (
    plot_agentic,
    print_agentic_level,
    print_agentic_summary,
    summarize_agentic,
)
from serving.client import Target
from serving.load import closed_loop
from serving.options import add_target_args, check_target_args, nonnegative, positive
from serving.prompts import PromptMaker
from serving.runner import auth_headers, run_against_server, served_model
from serving.trace import Session, TraceSpec, describe, make_trace, to_weka
from serving.variants import (
    check_variants,
    plot_variants,
    rows,
    run_variant,
    server_args,
    table_markdown,
    table_text,
    variant,
)

DEFAULTS: dict[str, Any] = {"sessions": [4, 16], "turns": 8, "initial_tokens": 4096}
DEFAULTS |= {"output_tokens": 256, "warmup_requests": 2}
SMOKE: dict[str, Any] = {"sessions": [2, 4], "turns": 3, "initial_tokens": 96}
SMOKE |= {"output_tokens": 8, "warmup_requests": 1}
WARMUP_TOKENS = 32


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    headers, spec = auth_headers(args), trace_spec(args)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as http:
        model = args.model or await served_model(http)
        maker = PromptMaker(http, model)
        await maker.setup(random.Random(f"{args.seed}-calibration"))
        # Every text before the first measurement: tokenize calls load the server too.
        plans = []
        for i, n in enumerate(args.sessions):
            trace = make_trace(spec, n, f"{args.seed}-level{i}")
            if args.trace_out:
                write_weka(args.trace_out / f"sessions{n}", trace, model)
            rng = random.Random(f"{args.seed}-text{i}")
            texts = await session_texts(maker, rng, trace, args.answers == "trace")
            plans.append((trace, texts))
        warm_sizes = [WARMUP_TOKENS] * args.warmup_requests
        warm = await maker.make_many(random.Random(f"{args.seed}-warmup"), warm_sizes)
    target = Target(
        path="/v1/chat/completions",
        model=model,
        output_len=spec.output_tokens,  # each turn sends its own max_tokens
        ignore_eos=True,  # answers as long as the trace says
        extra_body=args.extra_body,
        continuous_usage=args.continuous_usage,
    )
    if warm:
        limits = httpx.Limits(max_connections=len(warm))
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as http:
            await closed_loop(http, target, warm, len(warm))
    levels = []
    for trace, texts in plans:
        results, wall, cpu, server = await replay(url, headers, timeout, target, trace, texts)
        level = summarize_agentic(len(trace), results, wall, cpu, server, args.num_gpus)
        level["trace"] = describe(trace)
        print_agentic_level(level)
        levels.append(level)
    return {"model": model, "prompt_tokens_source": maker.source, "levels": levels}


def write_weka(directory: Path, trace: Sequence[Session], model: str) -> None:
    """One Weka trace file per session (aiperf's weka_trace loader takes the directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    for session in trace:
        (directory / f"{session.sid}.json").write_text(json.dumps(to_weka(session, model)))


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    return TraceSpec(
        turns=args.turns,
        initial_tokens=args.initial_tokens,
        initial_sigma=args.initial_sigma,
        new_frac=args.new_frac,
        min_new_tokens=args.min_new_tokens,
        output_tokens=args.output_tokens,
        output_sigma=args.output_sigma,
        think_time=args.think_time,
    )


def levels_list(text: str) -> list[int]:
    values = [positive(v) for v in text.replace(",", " ").split()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one session count")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_args(parser)
    load = parser.add_argument_group("load (defaults in brackets; --smoke changes them)")
    load.add_argument("--sessions", type=levels_list, help="levels, e.g. 4,16 [4,16]")
    load.add_argument("--num-gpus", type=positive, default=1, help="throughput divisor [1]")
    load.add_argument("--warmup-requests", type=nonnegative, help="not counted [2]")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds [600]")
    trace = parser.add_argument_group("trace (serving/trace.py)")
    trace.add_argument("--turns", type=positive, help="turns per session [8]")
    trace.add_argument("--initial-tokens", type=positive, help="system prompt median [4096]")
    trace.add_argument("--initial-sigma", type=float, default=0.5, help="its lognormal sigma")
    trace.add_argument("--new-frac", type=float, default=0.02, help="new tokens per turn, share")
    trace.add_argument("--min-new-tokens", type=positive, default=16)
    trace.add_argument("--output-tokens", type=positive, help="answer median [256]")
    trace.add_argument("--output-sigma", type=float, default=0.5)
    trace.add_argument("--think-time", type=float, default=0.0, help="median pause, s [0]")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument(
        "--answers",
        choices=("server", "trace"),
        default="server",
        help="assistant messages resent: the server's streamed text, or trace text of the "
        "answer's size (random-weight models: their answers do not re-tokenize) [server]",
    )
    trace.add_argument("--no-continuous-usage", dest="continuous_usage", action="store_false")
    trace.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged in")
    parser.add_argument(
        "--variant",
        dest="variants",
        type=variant,
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="a server variant (repeatable): --server-args plus FLAGS, each run in turn",
    )
    parser.add_argument(
        "--trace-out", type=Path, help="also write each level's trace as Weka JSON files here"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny fast run (CI): " + str(SMOKE))
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path [{default_out()}]")
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_target_args(parser, args)
    check_variants(parser, args)
    # Each variant's own namespace: its whole flag string checked (and its --api-key taken).
    args.variant_args = []
    for v in args.variants:
        vargs = copy.copy(args)
        vargs.server_args, vargs.variants = server_args(args.server_args, v), []
        check_target_args(parser, vargs)
        args.variant_args.append(vargs)
    args.out = args.out or default_out()
    return args


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "bench_agentic.json" if out else Path("perf/results/bench_agentic.json")


def title_of(args: argparse.Namespace, model: str) -> str:
    spec = trace_spec(args)
    return (
        f"agentic trace, model {model}: {spec.turns} turns/session, system prompt "
        f"~{spec.initial_tokens}, +{spec.new_frac:.0%}/turn, answers ~{spec.output_tokens}; "
        f"{platform.machine()}, {os.cpu_count()} cpus, {args.num_gpus} GPU(s) as divisor"
    )


def header(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON's fields that describe the run rather than its results."""
    return {
        "benchmark": "bench_agentic",
        "command": shlex.join(["python", "perf/bench_agentic.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "config": {"trace": trace_spec(args).as_dict(), "seed": args.seed}
        | {"num_gpus": args.num_gpus, "warmup_requests": args.warmup_requests}
        | {"extra_body": args.extra_body, "answers": args.answers},
    }


def write(args: argparse.Namespace, full: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {args.out}")


def main_variants(args: argparse.Namespace) -> int:
    """Every --variant in turn on the same trace; 1 if one of them failed."""
    variants = []
    for v, vargs in zip(args.variants, args.variant_args, strict=True):
        print(f"### variant {v.name}: m3serve serve {vargs.server_args}", flush=True)
        report = run_variant(vargs.server_args, functools.partial(run, vargs))
        if "error" in report:
            print(f"variant {v.name} failed: {report['error']}\n{report.get('server_log_tail')}")
        variants.append({"name": v.name, "flags": v.flags, "server_args": vargs.server_args})
        variants[-1] |= report
    table = rows(variants)
    model = next((v["model"] for v in variants if "model" in v), "?")
    title = title_of(args, model) + (f"; all with {args.server_args}" if args.server_args else "")
    print(f"{title}\n{table_text(table)}\n\n{table_markdown(table)}")
    full = header(args) | {"server": {"common_args": args.server_args, "started_here": True}}
    write(args, full | {"model": model, "table": table, "variants": variants})
    picture = plot_variants(table, args.out.with_suffix(".png"), title)
    if picture is not None:
        print(f"wrote {picture}")
    return 1 if any("error" in v for v in variants) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.variants:
        return main_variants(args)
    report, url, started_here = run_against_server(args, lambda url: run(args, url))
    title = title_of(args, report["model"])
    print(f"{title}; server {url}{' (started here)' if started_here else ''}")
    print_agentic_summary(report["levels"])
    server = {"url": url, "started_here": started_here, "args": args.server_args}
    write(args, header(args) | {"server": server, **report})
    picture = plot_agentic(report["levels"], args.out.with_suffix(".png"), title)
    if picture is not None:
        print(f"wrote {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
