"""Serving benchmark: an async load generator for any OpenAI-compatible server (streamed
/v1/chat/completions or /v1/completions), by default against `m3serve serve` started here.

    # m3serve on a free port (the built-in tiny model unless --server-args names one)
    python perf/bench_serving.py --concurrency 1 16 64 --input-len 1024 --output-len 128
    python perf/bench_serving.py --server-args "--model-path /ckpt --max-running-requests 64" \\
        --concurrency 1 8 --request-rate 2 8 inf --num-requests 200
    # any running OpenAI-compatible server
    python perf/bench_serving.py --url http://127.0.0.1:8000 --model my-model \\
        --endpoint completions --input-len 512 --input-len-dist normal --input-len-spread 64
    # what CI runs (tests/e2e/test_bench_serving.py): tiny model, 3 levels of 8 requests
    python perf/bench_serving.py --smoke --out /tmp/bench_serving.json

Load. Each level is its own measurement, run one after another on a fresh connection pool:
`--concurrency C` is a closed loop (C workers, each sends its next request as soon as its last
one finished, until `--num-requests` have been sent); `--request-rate R` is an open loop
(requests sent at Poisson arrivals, exponential gaps of mean 1/R s, whether or not earlier ones
finished; `inf` sends all at once). Before each level `--warmup-requests` requests on their own
prompts are sent and not counted. Every level (and every warm-up) gets fresh random prompts
(seeded by `--seed` and the level's index), so a prefix cache never serves one level's prompts
to another.

Requests. Streamed, with `stream_options: {include_usage, continuous_usage_stats}` (the latter
not with `--no-continuous-usage`), `max_tokens = --output-len` and
`ignore_eos: true` (a server that ignores it may stop early: the real counts are reported). The
prompt is random English words, one user message for chat or the raw prompt for completions.
Its token count (before any chat template) is drawn from `--input-len-dist`: `fixed` (=
`--input-len`), `uniform` (integers in input-len ± spread) or `normal` (mean input-len, std
spread, at least 1); spread defaults to input-len/4. The count is realized with the server's
own tokenizer (POST /v1/tokenize, else /tokenize, `{"prompt": ..., "add_special_tokens":
false}`: m3serve, vLLM and SGLang have it) by bisecting on the number of words and topping up
with one-token words; without such an endpoint it is approximated at 1.3 tokens per word and the
JSON says so (`prompt_tokens_source`). Either way the input tokens the throughput counts are the
server's own `usage.prompt_tokens` (chat template included) where it sends usage, else the prompt
text's count (`input_tokens_source`).

Metrics, from client-side time.perf_counter() stamps, per level. A chunk is one SSE `data:`
event; it is *content-bearing* when a choice in it has non-empty `delta.content`,
`delta.reasoning_content`, `delta.reasoning` or `delta.tool_calls` (chat) or `text`
(completions) — role-only, finish-only and usage-only chunks and [DONE] are not. A chunk is
stamped when the network read that completes it returns, so events that arrive in one read share
a stamp. Per request, with t0 = just before the request is sent:
    TTFT = t(first content chunk) - t0
    E2E  = t(last content chunk) - t0
    TPOT = (E2E - TTFT) / (output tokens - 1)              (requests with >= 2 output tokens)
    ITL  = per token where every content chunk carries the running usage.completion_tokens
           (vLLM's continuous_usage_stats; m3serve sends it): a chunk bringing k new tokens a
           gap g after the previous one counts as k gaps of g/k; per chunk otherwise,
           t(content chunk i) - t(content chunk i-1). Every gap of every request, pooled.
    output tokens = usage.completion_tokens of the stream's usage chunk; a server that sends no
        usage falls back to one token per content chunk (`output_tokens_source`: chunks)
`itl_definition` in the JSON says which ITL `itl_ms` holds; `itl_chunk_ms` is always the per
chunk one (what a client sees between chunks), and `tokens_per_chunk` (output tokens / content
chunks) says how many tokens a chunk held. Per chunk, a server that packs k tokens into a chunk
(its detokenizer holding back partial UTF-8 or a possible stop string, as random-weight models
often make it) shows gaps k tokens long and k-1 fewer of them, which inflates the percentiles;
TPOT is per token either way. E2E_done (JSON only) runs to the
[DONE] event. Over the level, with T = wall time from the first send to the last stream's end:
    requests/s = completed requests / T; input tokens/s = sum(input tokens) / T;
    output tokens/s = sum(output tokens) / T; mean in-flight = sum(E2E_done, all requests) / T
(completed requests only in the sums, failed ones too in mean in-flight);
    prompt_cache_hit = sum(usage cached_tokens) / sum(usage prompt_tokens)
(the share of the prompt tokens the server's prefix cache served; over half, the level warns:
its prompts were sent before, e.g. by another run with the same --seed, so it measured little
prefill)
Statistics are mean and the percentiles p50/p90/p99 by linear interpolation between order
statistics (numpy's default). Failed requests (transport error, HTTP status other than 200,
an `error` event, a stream with no content or without [DONE]) count in `failed` with their
messages in `errors` and in no latency metric; completed ones with fewer output tokens than
asked count in `short_outputs`. The client's own CPU share is reported: near 100% of a core the
client, not the server, is what is measured.

Client processes (`--client-procs N`, default 1: all in this process). A level's closed-loop
workers (C // N each, the prompts in proportion) or open-loop arrivals (one Poisson schedule,
request i to process i % N) are split over N spawned processes, each running the same async loop
on its share after its own warm-up and a barrier; their RequestRecords come back here and every
statistic is computed over all of them as for one process, T from the first send to the last
stream's end in any process (serving/procs.py). `client_cpu_util` is then the sum over the
processes, `client_cpu_util_max` the busiest one's, `client_procs` how many ran (at most C).

Against aiperf's and guidellm's own metric code (aiperf metrics/types/, guidellm
schemas/request_stats.py; both stamp content-bearing chunks only, as here):
TTFT is aiperf's `time_to_first_token` and guidellm's `time_to_first_token_ms`; E2E is aiperf's
`request_latency` (to the last content chunk; guidellm's `request_latency` runs to the stream's
end, our E2E_done); TPOT is aiperf's `inter_token_latency` and guidellm's
`inter_token_latency_ms` (same formula, as in vLLM's and SGLang's bench_serving) — guidellm's
`time_per_output_token_ms` is a different quantity, (last token - t0) / output tokens, TTFT
included; our per-chunk ITL is aiperf's `inter_chunk_latency` and vLLM's ITL (guidellm keeps no
per-gap distribution); the per-token ITL has no counterpart there. aiperf divides TPOT by
(output tokens - tokens of the first chunk) where the server reports per-chunk usage; here the
first chunk is taken to hold one token. Throughputs follow aiperf's (totals over the
benchmark's duration).

Decode probe (`--decode-probe N`): after the levels, N requests at once (prompts of
--input-len, `--decode-probe-output-len` tokens, default 4 x --output-len); the median per-token
gap between the last one's first token and the first one's end is the pure decode step time at
batch N, `ideal_tok_s` = N / step, and the closed-loop level at concurrency N gets `efficiency`
= its output tokens/s / ideal_tok_s (serving/probe.py; issue 11's "≥ 85% at concurrency 64").

Output: a table per level as it finishes and a summary; JSON at `--out` (default
perf/results/bench_serving.json, or $OUT/bench_serving.json when $OUT is set) with every level's
metrics, per-request records and wall-clock window (`clock`; the probe's too); a PNG next to it
(output tokens/s and ITL p50/p99 against concurrency; open-loop levels at their mean in-flight
count) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
from serving.client import Target
from serving.load import run_level
from serving.options import parse_args
from serving.probe import add_efficiency, decode_probe, print_probe
from serving.prompts import PromptMaker, input_lengths
from serving.report import plot, print_level, print_summary
from serving.runner import auth_headers, run_against_server, served_model


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    headers = auth_headers(args)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as http:
        model = args.model or await served_model(http)
        maker = PromptMaker(http, model)
        await maker.setup(random.Random(f"{args.seed}-calibration"))
        levels = [{"mode": "concurrency", "concurrency": c} for c in args.concurrency]
        levels += [{"mode": "request_rate", "request_rate": r} for r in args.request_rate]
        lengths = (args.input_len, args.input_len_spread, args.input_len_dist)
        # Every prompt before the first measurement: tokenize calls load the server too.
        plans = []
        for i, level in enumerate(levels):
            rng = random.Random(f"{args.seed}-level{i}")
            warm_rng = random.Random(f"{args.seed}-warmup{i}")
            prompts = await maker.make_many(rng, input_lengths(rng, args.num_requests, *lengths))
            warm = await maker.make_many(
                warm_rng, input_lengths(warm_rng, args.warmup_requests, *lengths)
            )
            plans.append((level, warm, prompts, random.Random(f"{args.seed}-arrivals{i}")))
        probe_prompts = []
        if args.decode_probe:  # one length for all: every request is in the same phase
            rng = random.Random(f"{args.seed}-probe")
            probe_prompts = await maker.make_many(rng, [args.input_len] * args.decode_probe)
    target = Target(
        path="/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions",
        model=model,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        extra_body=json.loads(args.extra_body),
        continuous_usage=args.continuous_usage,
    )
    results = []
    for level, warm, prompts, arrivals in plans:
        level |= {"num_requests": len(prompts), "output_len": args.output_len}
        since = clock()
        result = await run_level(
            url, headers, timeout, target, level, warm, prompts, arrivals, args.client_procs
        )
        result["clock"] = [since, clock()]
        print_level(result)
        results.append(result)
    report = {"model": model, "prompt_tokens_source": maker.source, "levels": results}
    if probe_prompts:
        since = clock()
        probe = await decode_probe(
            url, headers, timeout, target, probe_prompts, args.decode_probe_output_len
        )
        probe["clock"] = [since, clock()]
        add_efficiency(probe, results, args.prefill_us_per_token)
        print_probe(probe)
        report["decode_probe"] = probe
    return report


def clock() -> str:
    """The wall clock as HH:MM:SS.mmm, as the server's log lines stamp it: a level's `clock`
    window (its warm-up requests included) and the probe's let `summarize_step_trace.py
    --since/--until` take each one's steps alone."""
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    report, url, started_here = run_against_server(args, lambda url: run(args, url))

    endpoint = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    title = (
        f"{endpoint} streamed, model {report['model']}; input {args.input_len} tokens "
        f"({args.input_len_dist}), output {args.output_len}; {platform.machine()}, "
        f"{os.cpu_count()} cpus"
    )
    print(
        f"{title}; server {url}{' (started here)' if started_here else ''}; prompt tokens by "
        f"{report['prompt_tokens_source']}"
    )
    print_summary(report["levels"])
    if "decode_probe" in report:
        print_probe(report["decode_probe"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    full = {
        "benchmark": "bench_serving",
        "command": shlex.join(["python", "perf/bench_serving.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "server": {"url": url, "started_here": started_here, "args": args.server_args},
        "config": {
            "endpoint": endpoint,
            "input_len": args.input_len,
            "input_len_dist": args.input_len_dist,
            "input_len_spread": args.input_len_spread,
            "output_len": args.output_len,
            "ignore_eos": args.ignore_eos,
            "continuous_usage_stats": args.continuous_usage,
            "extra_body": json.loads(args.extra_body),
            "num_requests": args.num_requests,
            "warmup_requests": args.warmup_requests,
            "seed": args.seed,
            "client_procs": args.client_procs,
            "decode_probe": args.decode_probe,
            "decode_probe_output_len": args.decode_probe_output_len,
        },
        **report,
    }
    args.out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {args.out}")
    picture = plot(report["levels"], args.out.with_suffix(".png"), title)
    if picture is not None:
        print(f"wrote {picture}")


if __name__ == "__main__":
    main()
