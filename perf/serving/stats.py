"""Statistics (mean and interpolated percentiles) and the summary of one load level."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from serving.client import RequestRecord


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
        "prompt_cache_hit": prompt_cache_hit(ok),
        "prompt_text_tokens": stats(r.prompt_text_tokens for r in ok),
        "input_tokens": stats(r.input_tokens for r in ok),
        "output_tokens": stats(r.output_tokens for r in ok),
        "ttft_ms": stats(1e3 * r.ttft for r in ok),
        "tpot_ms": stats(1e3 * t for r in ok if (t := r.tpot) is not None),
        "itl_definition": itl_definition(ok),
        "itl_ms": stats(1e3 * gap for r in ok for gap in r.token_itls),
        "itl_chunk_ms": stats(1e3 * gap for r in ok for gap in r.itls),
        "e2e_ms": stats(1e3 * r.e2e for r in ok),
        "e2e_done_ms": stats(1e3 * r.e2e_done for r in ok),
        "arrival_lag_ms": stats(1e3 * lag for lag in lags) if lags else None,
        "requests": [r.summary() for r in records],
    }


def prompt_cache_hit(records: Sequence[RequestRecord]) -> float | None:
    """The share of the prompt tokens the server found in its prefix cache
    (usage.prompt_tokens_details.cached_tokens), None where it reported none. Near 1, the
    level measured little prefill: its prompts had been sent before."""
    counted = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    total = sum(r.prompt_tokens or 0 for r in counted)
    return sum(r.cached_tokens or 0 for r in counted) / total if total else None


def _source(with_usage: int, requests: int, fallback: str) -> str:
    """Where a level's token counts came from: the server's usage, the fallback, or both."""
    return (
        "usage"
        if with_usage == requests
        else f"no usage: {fallback}"
        if with_usage == 0
        else "mixed"
    )


def itl_definition(records: Sequence[RequestRecord]) -> str:
    """Which inter-token latency `itl_ms` holds: per token where every content chunk carried
    the running completion count, else per chunk (see serving/client.py)."""
    counted = sum(r.token_counted for r in records)
    if counted == len(records):
        return "per token: a chunk of k new tokens after a gap g counts as k gaps of g/k"
    if counted == 0:
        return "per chunk: the server sent no per-chunk usage (continuous_usage_stats)"
    return f"mixed: per token for {counted} of {len(records)} requests, per chunk for the rest"
