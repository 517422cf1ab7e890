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

Requests. Streamed, with `stream_options.include_usage`, `max_tokens = --output-len` and
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
    ITL  = t(content chunk i) - t(content chunk i-1)       (every gap of every request, pooled)
    output tokens = usage.completion_tokens of the stream's usage chunk; a server that sends no
        usage falls back to one token per content chunk (`output_tokens_source`: chunks)
ITL is per chunk, not per token: a server that packs k tokens into a chunk shows gaps k tokens
long (and k-1 fewer of them); TPOT is the per-token figure, and `tokens_per_chunk` (output
tokens / content chunks) says how many tokens a gap held. E2E_done (JSON only) runs to the
[DONE] event. Over the level, with T = wall time from the first send to the last stream's end:
    requests/s = completed requests / T; input tokens/s = sum(input tokens) / T;
    output tokens/s = sum(output tokens) / T; mean in-flight = sum(E2E_done, all requests) / T
(completed requests only in the sums, failed ones too in mean in-flight)
Statistics are mean and the percentiles p50/p90/p99 by linear interpolation between order
statistics (numpy's default). Failed requests (transport error, HTTP status other than 200,
an `error` event, a stream with no content or without [DONE]) count in `failed` with their
messages in `errors` and in no latency metric; completed ones with fewer output tokens than
asked count in `short_outputs`. The client's own CPU share is reported: near 100% of a core the
client, not the server, is what is measured.

Against aiperf's and guidellm's own metric code (aiperf metrics/types/, guidellm
schemas/request_stats.py; both stamp content-bearing chunks only, as here):
TTFT is aiperf's `time_to_first_token` and guidellm's `time_to_first_token_ms`; E2E is aiperf's
`request_latency` (to the last content chunk; guidellm's `request_latency` runs to the stream's
end, our E2E_done); TPOT is aiperf's `inter_token_latency` and guidellm's
`inter_token_latency_ms` (same formula, as in vLLM's and SGLang's bench_serving) — guidellm's
`time_per_output_token_ms` is a different quantity, (last token - t0) / output tokens, TTFT
included; our per-chunk ITL is aiperf's `inter_chunk_latency` and vLLM's ITL (guidellm keeps no
per-gap distribution). aiperf divides by (output tokens - tokens of the first chunk) where the
server reports per-chunk usage; here the first chunk is taken to hold one token. Throughputs
follow aiperf's (totals over the benchmark's duration).

Output: a table per level as it finishes and a summary; JSON at `--out` (default
perf/results/bench_serving.json, or $OUT/bench_serving.json when $OUT is set) with every level's
metrics and per-request records; a PNG next to it (output tokens/s and ITL p50/p99 against
concurrency; open-loop levels at their mean in-flight count) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Common English words: realistic for a real tokenizer (≈1.3 tokens each), and with a
# whitespace-splitting pre-tokenizer each word's tokens do not depend on its neighbours. (A
# string, not a list literal: the formatter would put each word on a line of its own.)
WORDS = """
the of and to in is was for that with as on by at from his an were are which this be or had
not but first one their its new after who they have her she two been other when there all
during into school time may years more most only over city some world would where later up
such used many can state about national out known university united then made also american
both these three between team well several part film since war century group
system number people water game season work series house music early river small
life long great right year place high light power area family open point order field
study market model value change story answer table window garden letter summer winter morning
""".split()  # noqa: SIM905
APPROX_TOKENS_PER_WORD = 1.3
# Appended to top a prompt up to its exact token count; the first that adds one token per copy.
FILLERS = (" a", " the", " x", " .", ".")
CALIBRATION_WORDS = 256
TOKENIZE_CONCURRENCY = 8
TOKENIZE_PATHS = ("/v1/tokenize", "/tokenize")
ERROR_CHARS = 300

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


# ---------------------------------------------------------------------- one streamed request


@dataclass
class RequestRecord:
    """One request's client-side stamps (time.perf_counter seconds) and the server's counts."""

    start: float
    prompt_text_tokens: int
    scheduled: float | None = None  # open loop: when the Poisson schedule wanted it sent
    chunk_times: list[float] = field(default_factory=list)  # content-bearing chunks only
    done: float | None = None  # [DONE] arrived, or the request failed
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_text_tokens

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def e2e_done(self) -> float:
        assert self.done is not None
        return self.done - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    def summary(self) -> dict[str, Any]:
        """The per-request row of the JSON (no per-gap list: that would dwarf the rest)."""
        row: dict[str, Any] = {"ok": self.ok}
        if self.ok:
            tpot = self.tpot
            row |= {
                "ttft_ms": 1e3 * self.ttft,
                "e2e_ms": 1e3 * self.e2e,
                "tpot_ms": None if tpot is None else 1e3 * tpot,
                "content_chunks": len(self.chunk_times),
            }
        else:
            row["error"] = self.error
        return row | {
            "prompt_text_tokens": self.prompt_text_tokens,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


class StreamParser:
    """Splits an SSE byte stream into `data:` events and records what each one carries."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.buffer = b""
        self.saw_done = False

    def feed(self, data: bytes, now: float) -> None:
        # SSE allows CRLF line ends. A CR split from its LF by a read stays at the buffer's end
        # (no event can end there yet) and meets the LF on the next read.
        self.buffer = (self.buffer + data).replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return  # a comment or a keep-alive
        payload = b"\n".join(lines)
        if payload.strip() == b"[DONE]":
            self.saw_done = True
            self.record.done = now
            return
        message = json.loads(payload)
        if not isinstance(message, dict):
            raise ValueError(f"unexpected event {payload[:ERROR_CHARS]!r}")
        if message.get("error"):
            raise RuntimeError(f"error event: {json.dumps(message['error'])[:ERROR_CHARS]}")
        usage = message.get("usage")
        if usage:  # some servers send "usage": null on every chunk
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.completion_tokens = usage.get("completion_tokens")
        if any(_has_output(choice) for choice in message.get("choices") or ()):
            self.record.chunk_times.append(now)


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        return bool(choice.get("text"))
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


@dataclass
class Target:
    path: str  # /v1/chat/completions or /v1/completions
    model: str
    output_len: int
    ignore_eos: bool
    extra_body: dict[str, Any]

    def body(self, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body |= {
            "max_tokens": self.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body | self.extra_body


@dataclass
class Prompt:
    text: str
    tokens: int  # by the server's tokenizer, or the approximation


async def send(
    http: httpx.AsyncClient, target: Target, prompt: Prompt, scheduled: float | None = None
) -> RequestRecord:
    body = target.body(prompt.text)
    record = RequestRecord(start=time.perf_counter(), prompt_text_tokens=prompt.tokens)
    record.scheduled = scheduled
    parser = StreamParser(record)
    try:
        async with http.stream("POST", target.path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:ERROR_CHARS]}")
            async for data in response.aiter_bytes():
                parser.feed(data, time.perf_counter())
        if not parser.saw_done:
            raise RuntimeError("the stream ended without [DONE]")
        if not record.chunk_times:
            raise RuntimeError("the stream carried no content")
    except Exception as exc:  # any failure is a failed request: counted, never dropped
        record.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    if record.done is None or not record.ok:
        record.done = time.perf_counter()
    return record


# ---------------------------------------------------------------------- load shapes


async def closed_loop(
    http: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt], concurrency: int
) -> list[RequestRecord]:
    todo = iter(prompts)  # shared by the workers: next() never yields to the event loop
    records: list[RequestRecord] = []

    async def worker() -> None:
        for prompt in todo:
            records.append(await send(http, target, prompt))

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return records


async def open_loop(
    http: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    rate: float,
    rng: random.Random,
) -> list[RequestRecord]:
    tasks: list[asyncio.Task[RequestRecord]] = []
    due = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(rate):
            due += rng.expovariate(rate)
            # A loop: the event loop's timers have millisecond resolution and may fire early.
            while (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(http, target, prompt, scheduled=due)))
    return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------- prompts


class PromptMaker:
    """Random-word prompts of an exact token count by the server's tokenizer, when it has one."""

    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http = http
        self.model = model
        self.path: str | None = None  # the tokenize endpoint, None = approximate
        self.tokens_per_word = APPROX_TOKENS_PER_WORD
        self.filler: str | None = None
        self.limit = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    @property
    def source(self) -> str:
        return f"server {self.path}" if self.path else "approximate (no tokenize endpoint)"

    async def setup(self, rng: random.Random) -> None:
        for path in TOKENIZE_PATHS:
            self.path = path
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                if await self.count("hello world") > 0:
                    break
            self.path = None
        if self.path is None:
            return
        sample = " ".join(rng.choice(WORDS) for _ in range(CALIBRATION_WORDS))
        self.tokens_per_word = await self.count(sample) / CALIBRATION_WORDS
        base = await self.count("hello")
        for filler in FILLERS:
            if await self.count("hello" + filler * 8) == base + 8:
                self.filler = filler
                break

    async def count(self, text: str) -> int:
        assert self.path is not None
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        async with self.limit:
            response = await self.http.post(self.path, json=body)
        response.raise_for_status()
        out = response.json()
        return int(out["count"]) if "count" in out else len(out["tokens"])

    async def make(self, rng: random.Random, length: int) -> Prompt:
        guess = max(1, round(length / self.tokens_per_word))
        words = [rng.choice(WORDS) for _ in range(2 * guess + 16)]
        if self.path is None:
            return Prompt(" ".join(words[:guess]), length)

        async def tokens(n: int) -> int:
            while len(words) < n:
                words.extend(rng.choice(WORDS) for _ in range(n))
            return await self.count(" ".join(words[:n]))

        # The longest prefix of `words` with at most `length` tokens. Each probe's error, in
        # words, points one word past the target; bisection takes over once the bracket is
        # known and the estimate falls outside it.
        lo, lo_tokens = 0, 0  # tokens(lo) <= length
        hi: int | None = None  # tokens(hi) > length
        n = guess
        while hi is None or hi - lo > 1:
            got = await tokens(n)
            jump = (length - got) / self.tokens_per_word
            if got <= length:
                lo, lo_tokens = n, got
                n += math.ceil(jump) + 1
            else:
                hi = n
                n += math.floor(jump) - 1
            if hi is not None and not lo < n < hi:
                n = (lo + hi) // 2
        text = " ".join(words[:lo])
        short = length - lo_tokens
        if short and self.filler is not None:
            topped = (text + self.filler * short) if text else (self.filler * short).lstrip()
            if await self.count(topped) == length:
                return Prompt(topped, length)
        return Prompt(text, lo_tokens)

    async def make_many(self, rng: random.Random, lengths: Sequence[int]) -> list[Prompt]:
        # One generator per prompt, drawn up front: the words then do not depend on the order in
        # which concurrent tokenize calls come back.
        rngs = [random.Random(rng.getrandbits(64)) for _ in lengths]
        return list(
            await asyncio.gather(*(self.make(r, n) for r, n in zip(rngs, lengths, strict=True)))
        )


def input_lengths(rng: random.Random, count: int, args: argparse.Namespace) -> list[int]:
    mean, spread = args.input_len, args.input_len_spread
    if args.input_len_dist == "fixed":
        return [mean] * count
    if args.input_len_dist == "uniform":
        return [
            rng.randint(max(1, round(mean - spread)), round(mean + spread)) for _ in range(count)
        ]
    return [max(1, round(rng.gauss(mean, spread))) for _ in range(count)]


# ---------------------------------------------------------------------- statistics


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy.percentile's default)."""
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def stats(values: Iterable[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "n": len(ordered),
        "mean": math.fsum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "min": ordered[0],
        "max": ordered[-1],
    }


def summarize(
    level: dict[str, Any], records: list[RequestRecord], wall: float, client_cpu: float
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_len = level["output_len"]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.input_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    with_usage = sum(r.completion_tokens is not None for r in ok)
    prompt_usage = sum(r.prompt_tokens is not None for r in ok)
    lags = [r.start - r.scheduled for r in records if r.scheduled is not None]
    return level | {
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "short_outputs": sum(r.output_tokens < output_len for r in ok),
        "duration_s": wall,
        "request_throughput": len(ok) / wall,
        "input_token_throughput": input_tokens / wall,
        "output_token_throughput": output_tokens / wall,
        "mean_in_flight": math.fsum(r.e2e_done for r in records) / wall,
        "client_cpu_util": client_cpu / wall,
        "input_tokens_source": _source(prompt_usage, len(ok), "prompt text"),
        "output_tokens_source": _source(with_usage, len(ok), "chunks"),
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "prompt_text_tokens": stats(r.prompt_text_tokens for r in ok),
        "input_tokens": stats(r.input_tokens for r in ok),
        "output_tokens": stats(r.output_tokens for r in ok),
        "ttft_ms": stats(1e3 * r.ttft for r in ok),
        "tpot_ms": stats(1e3 * t for r in ok if (t := r.tpot) is not None),
        "itl_ms": stats(1e3 * gap for r in ok for gap in r.itls),
        "e2e_ms": stats(1e3 * r.e2e for r in ok),
        "e2e_done_ms": stats(1e3 * r.e2e_done for r in ok),
        "arrival_lag_ms": stats(1e3 * lag for lag in lags) if lags else None,
        "requests": [r.summary() for r in records],
    }


def _source(with_usage: int, requests: int, fallback: str) -> str:
    """Where a level's token counts came from: the server's usage, the fallback, or both."""
    return (
        "usage"
        if with_usage == requests
        else f"no usage: {fallback}"
        if with_usage == 0
        else "mixed"
    )


# ---------------------------------------------------------------------- the run


def level_name(level: dict[str, Any]) -> str:
    if level["mode"] == "concurrency":
        return f"concurrency {level['concurrency']}"
    return f"request rate {level['request_rate']:g}/s"


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as http:
        model = args.model or await served_model(http)
        maker = PromptMaker(http, model)
        await maker.setup(random.Random(f"{args.seed}-calibration"))
        levels = [{"mode": "concurrency", "concurrency": c} for c in args.concurrency]
        levels += [{"mode": "request_rate", "request_rate": r} for r in args.request_rate]
        # Every prompt before the first measurement: tokenize calls load the server too.
        plans = []
        for i, level in enumerate(levels):
            rng = random.Random(f"{args.seed}-level{i}")
            warm_rng = random.Random(f"{args.seed}-warmup{i}")
            prompts = await maker.make_many(rng, input_lengths(rng, args.num_requests, args))
            warm = await maker.make_many(
                warm_rng, input_lengths(warm_rng, args.warmup_requests, args)
            )
            plans.append((level, warm, prompts, random.Random(f"{args.seed}-arrivals{i}")))
    target = Target(
        path="/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions",
        model=model,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        extra_body=json.loads(args.extra_body),
    )
    results = []
    for level, warm, prompts, arrivals in plans:
        level |= {"num_requests": len(prompts), "output_len": args.output_len}
        result = await run_level(url, headers, timeout, target, level, warm, prompts, arrivals)
        print_level(result)
        results.append(result)
    return {"model": model, "prompt_tokens_source": maker.source, "levels": results}


async def served_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_level(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    level: dict[str, Any],
    warm: list[Prompt],
    prompts: list[Prompt],
    arrivals: random.Random,
) -> dict[str, Any]:
    concurrency = level.get("concurrency")
    # Closed loop: exactly as many connections as workers. Open loop: no pool limit, or requests
    # would wait for a connection inside the client and that wait would count as server time.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        if warm:
            await closed_loop(http, target, warm, concurrency or len(warm))
        started, cpu = time.perf_counter(), time.process_time()
        measure: Awaitable[list[RequestRecord]]
        if concurrency is not None:
            measure = closed_loop(http, target, prompts, concurrency)
        else:
            measure = open_loop(http, target, prompts, level["request_rate"], arrivals)
        records = await measure
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return summarize(level, records, wall, cpu)


# ---------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return f"{value:9.2f}" if value is not None else f"{'-':>9}"


def print_level(r: dict[str, Any]) -> None:
    print(
        f"== {level_name(r)}: {r['num_requests']} requests, {r['completed']} ok, "
        f"{r['failed']} failed, {r['duration_s']:.2f} s, client CPU {r['client_cpu_util']:.0%}"
    )
    print(
        f"requests/s {r['request_throughput']:.2f} | input tokens/s "
        f"{r['input_token_throughput']:.1f} | output tokens/s {r['output_token_throughput']:.1f}"
        f" | mean in flight {r['mean_in_flight']:.1f}"
    )
    if r["completed"]:
        tpc = r["tokens_per_chunk"]
        text = f"{r['input_tokens_source']}; prompt text {r['prompt_text_tokens']['mean']:.1f}"
        print(
            f"per request: input tokens {r['input_tokens']['mean']:.1f} ({text}), output tokens "
            f"{r['output_tokens']['mean']:.1f} ({r['output_tokens_source']}), "
            f"tokens/chunk {tpc:.2f}"
        )
        print(f"{'(ms)':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
        for name in ("ttft", "tpot", "itl", "e2e"):
            s = r[f"{name}_ms"]
            print(f"{name.upper():<6}" + "".join(_ms(s[k]) for k in ("mean", "p50", "p90", "p99")))
    for error, count in r["errors"].items():
        print(f"  {count} x {error}")
    if r["short_outputs"]:
        print(f"  {r['short_outputs']} completed requests had fewer than {r['output_len']} tokens")
    if r["client_cpu_util"] > 0.8 and r["duration_s"] > 1.0:  # shorter runs: too noisy to say
        print("  warning: the client used most of a CPU core; it may limit what is measured")
    print(flush=True)


def print_summary(levels: list[dict[str, Any]]) -> None:
    print(
        f"{'level':<18}{'ok':>5}{'fail':>5}{'req/s':>8}{'in tok/s':>10}{'out tok/s':>10}"
        f"{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>7}"
        f"{'E2E p50':>9}{'p99':>8}"
    )
    for r in levels:
        print(
            f"{level_name(r):<18}{r['completed']:5d}{r['failed']:5d}"
            f"{r['request_throughput']:8.2f}{r['input_token_throughput']:10.1f}"
            f"{r['output_token_throughput']:10.1f}"
            + "".join(
                _cell(r[f"{name}_ms"][key], width)
                for name, widths in (
                    ("ttft", (9, 8)),
                    ("tpot", (9, 7)),
                    ("itl", (8, 7)),
                    ("e2e", (9, 8)),
                )
                for key, width in zip(("p50", "p99"), widths, strict=True)
            )
        )


def _cell(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def plot(levels: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: the plot only goes to a file
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib for one)")
        return None
    series: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
        ("concurrency", "o-", lambda r: r["concurrency"]),
        ("request_rate", "s--", lambda r: r["mean_in_flight"]),
    ]
    labels = {"concurrency": "closed loop", "request_rate": "Poisson (at mean in flight)"}
    fig, (tput, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style, x_of in series:
        rows = sorted((r for r in levels if r["mode"] == mode and r["completed"]), key=x_of)
        if not rows:
            continue
        xs = [x_of(r) for r in rows]
        tput.plot(xs, [r["output_token_throughput"] for r in rows], style, label=labels[mode])
        for key, color in (("p50", "tab:blue"), ("p99", "tab:red")):
            ys = [r["itl_ms"][key] for r in rows]
            itl.plot(xs, ys, style, color=color, label=f"ITL {key}, {labels[mode]}")
    for ax, name in ((tput, "output tokens/s"), (itl, "inter-token (chunk) latency, ms")):
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(name)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1 2 4, not 2^k
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- command line


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="a running OpenAI-compatible server; default: start m3serve")
    target.add_argument(
        "--server-args", default="", help="flags for the m3serve serve started here, one string"
    )
    target.add_argument("--model", help="the model name to send; default: the first /v1/models")
    target.add_argument("--api-key", help="sent as a Bearer token")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = parser.add_argument_group("load (defaults in brackets; --smoke changes them)")
    load.add_argument(
        "--concurrency", type=positive, nargs="*", help="closed-loop levels [1 16 64]"
    )
    load.add_argument("--request-rate", type=rate, nargs="*", help="requests/s, Poisson; [none]")
    load.add_argument("--num-requests", type=positive, help="per level [64]")
    load.add_argument("--warmup-requests", type=nonnegative, help="per level, not counted [4]")
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
    if args.input_len_spread is None:
        args.input_len_spread = args.input_len / 4
    if not args.concurrency and not args.request_rate:
        parser.error("nothing to run: give --concurrency and/or --request-rate levels")
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
    if not isinstance(json.loads(args.extra_body), dict):
        parser.error("--extra-body must be a JSON object")
    args.out = args.out or default_out()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    served = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        from server_process import start_m3serve  # perf/ is on sys.path when run by path

        served = start_m3serve(shlex.split(args.server_args))
        url = served.url
    try:
        report = _event_loop_run(run(args, url))
    finally:
        if served is not None:
            served.stop()

    endpoint = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    title = (
        f"{endpoint} streamed, model {report['model']}; input {args.input_len} tokens "
        f"({args.input_len_dist}), output {args.output_len}; {platform.machine()}, "
        f"{os.cpu_count()} cpus"
    )
    print(
        f"{title}; server {url}{' (started here)' if served else ''}; prompt tokens by "
        f"{report['prompt_tokens_source']}"
    )
    print_summary(report["levels"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    full = {
        "benchmark": "bench_serving",
        "command": shlex.join(["python", "perf/bench_serving.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "server": {"url": url, "started_here": served is not None, "args": args.server_args},
        "config": {
            "endpoint": endpoint,
            "input_len": args.input_len,
            "input_len_dist": args.input_len_dist,
            "input_len_spread": args.input_len_spread,
            "output_len": args.output_len,
            "ignore_eos": args.ignore_eos,
            "extra_body": json.loads(args.extra_body),
            "num_requests": args.num_requests,
            "warmup_requests": args.warmup_requests,
            "seed": args.seed,
        },
        **report,
    }
    args.out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {args.out}")
    picture = plot(report["levels"], args.out.with_suffix(".png"), title)
    if picture is not None:
        print(f"wrote {picture}")


def _event_loop_run(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:  # uvloop is faster, not needed
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    main()
