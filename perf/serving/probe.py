"""The decode probe: the pure decode step time at batch N, measured in the same run as the load
levels, and from it how much of the ideal decode throughput a closed loop of N reaches.

N requests are sent at once (same prompt length, long `ignore_eos` outputs). Once the last of
them has its first token, all N are decoding and none has finished — until the first one
finishes. Inside that window every engine step is a pure decode step of batch N (no prefill
chunk in it), so the inter-token gap there, per token (serving/client.py), is the step time.
It is the mean gap, not the median: a client that reads N streams in one process falls
behind at high token rates and takes several streams' chunks in one go, so single gaps shrink
to ~0 and stretch in between (an H200 run at N = 64 gave a median of 0.12 ms next to a 4.5 ms
step), while the time a request spends inside the window over the tokens it got there is not
moved by when the client happened to read them.

    pure_decode_step_ms = sum(gap time inside the window) / tokens inside it (all N pooled)
    ideal_tok_s         = N / pure decode step
    efficiency          = output tokens/s of the closed-loop level at concurrency N / ideal_tok_s

The efficiency is the share of the pure decode rate that survives prefills, scheduling and
streaming (issue 11: at least 85% at concurrency 64).

The prompts bound it from above whatever the server does. In steady state each decode step of
N rows emits N tokens, so N / output_len requests end, and as many start, a step: every decode
step brings `prompt_tokens_per_step` = input tokens x N / output_len prompt tokens to prefill.
Given a cost per prompt token (`--prefill-us-per-token`: the server's start-up log prints its
measure, or a FLOP floor: FLOPs a token / a matmul rate), no schedule does better than

    prefill_ceiling = step / (step + prompt_tokens_per_step x cost)

(a 4-layer M3.1 slice on the H200 at 1184 prompt and 256 output tokens: 296 prompt tokens a
step of 64 rows).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from typing import Any

import httpx

from serving.client import Prompt, RequestRecord, Target, expand, send
from serving.stats import itl_definition, stats


async def decode_probe(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    prompts: Sequence[Prompt],
    output_len: int,
) -> dict[str, Any]:
    """Send every prompt at once, each for `output_len` tokens, and measure the window."""
    n = len(prompts)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        sends = (send(http, target, prompt, output_len=output_len) for prompt in prompts)
        records = await asyncio.gather(*sends)
    return summarize_probe(list(records), output_len)


def window(records: Sequence[RequestRecord]) -> tuple[float, float] | None:
    """(last first token, first last token) of the requests, or None when they never all ran
    at once (the first finished before the last started: a batch limit below N?)."""
    start = max(r.chunk_times[0] for r in records)
    end = min(r.chunk_times[-1] for r in records)
    return (start, end) if end > start else None


def summarize_probe(records: list[RequestRecord], output_len: int) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "output_len": output_len,
        "errors": sorted({r.error for r in records if r.error is not None}),
    }
    span = window(ok) if len(ok) == len(records) and ok else None
    if span is None:
        reason = "a request failed" if len(ok) < len(records) else "the requests never all ran"
        return out | {"pure_decode_step_ms": None, "ideal_tok_s": None, "note": reason}
    start, end = span
    gaps = expand(s for r in ok for s in r.spans if s[0] >= start and s[1] <= end)
    if not gaps:
        return out | {"pure_decode_step_ms": None, "ideal_tok_s": None, "note": "no gap inside"}
    step = sum(gaps) / len(gaps)
    return out | {
        "window_s": end - start,
        "window_gaps": len(gaps),
        "itl_definition": itl_definition(ok),
        "pure_decode_step_ms": 1e3 * step,
        "median_gap_ms": 1e3 * statistics.median(gaps),
        "ideal_tok_s": len(records) / step,
        "step_ms": stats(1e3 * g for g in gaps),
    }


def add_efficiency(
    probe: dict[str, Any], levels: list[dict[str, Any]], prefill_us_per_token: float | None = None
) -> None:
    """The efficiency of the closed-loop level at the probe's concurrency, into both dicts, and
    the prompts' ceiling on it (module docstring) into the probe's."""
    probe["efficiency"] = None
    ideal = probe.get("ideal_tok_s")
    for level in levels:
        if level["mode"] == "concurrency" and level["concurrency"] == probe["requests"]:
            level["efficiency"] = None
            if ideal and level["completed"]:
                level["efficiency"] = level["output_token_throughput"] / ideal
                _add_ceiling(probe, level, prefill_us_per_token)
            probe["efficiency"] = level["efficiency"]
            probe["measured_output_tok_s"] = level["output_token_throughput"]


def _add_ceiling(
    probe: dict[str, Any], level: dict[str, Any], prefill_us_per_token: float | None
) -> None:
    prompt = level.get("input_tokens", {}).get("mean")
    if not prompt or not level.get("output_len"):
        return
    per_step = prompt * probe["requests"] / level["output_len"]
    probe["prompt_tokens_per_step"] = per_step
    if prefill_us_per_token:
        step = probe["pure_decode_step_ms"]
        probe["prefill_us_per_token"] = prefill_us_per_token
        probe["prefill_ceiling"] = step / (step + per_step * prefill_us_per_token / 1e3)


def print_probe(probe: dict[str, Any]) -> None:
    n = probe["requests"]
    print(f"== decode probe: {n} requests at once, {probe['output_len']} output tokens each")
    if probe["pure_decode_step_ms"] is None:
        print(f"  no measurement: {probe['note']}; errors {probe['errors']}", flush=True)
        return
    print(
        f"window {probe['window_s']:.3f} s, {probe['window_gaps']} gaps: pure decode step "
        f"{probe['pure_decode_step_ms']:.2f} ms (mean gap; median {probe['median_gap_ms']:.2f}, "
        f"p90 {probe['step_ms']['p90']:.2f}) -> ideal "
        f"{probe['ideal_tok_s']:.1f} output tokens/s at batch {n}"
    )
    if probe["efficiency"] is None:
        print(f"  (no closed-loop level at concurrency {n} to compare with)", flush=True)
    else:
        print(
            f"concurrency {n}: {probe['measured_output_tok_s']:.1f} output tokens/s = "
            f"{probe['efficiency']:.1%} of ideal",
            flush=True,
        )
    if probe.get("prefill_ceiling") is not None:
        print(
            f"the prompts bring {probe['prompt_tokens_per_step']:.0f} tokens a decode step; at "
            f"{probe['prefill_us_per_token']:g} us each no schedule passes "
            f"{probe['prefill_ceiling']:.1%} of ideal",
            flush=True,
        )
