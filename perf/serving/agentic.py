"""Replaying an agentic trace (serving/trace.py): N sessions at once, each sending its turns one
after another as a real multi-turn chat, so that a server's prefix cache can serve each turn's
resent conversation.

A session's messages are its system prompt, then per turn a user message of the turn's new
tokens; after each answer the assistant message with the text the server actually streamed
(its `delta.content`) is appended before the next turn — or, with `answers="trace"`, text of
the answer's size drawn like the prompts. A model with random weights streams token soup that
does not re-tokenize to itself (byte-fallback pieces decode to U+FFFD, which encodes to more
tokens), so with its own answers every later prompt outgrows the trace and misses the prefix
cache from the first answer on; a real model's answers round-trip, and trace answers stand in
for that. A failed turn ends its session (there
is no answer to continue from). Text sizes are exact by the server's tokenizer where it has a
tokenize endpoint (serving/prompts.py); the server's `usage.prompt_tokens` counts the rest
(chat template, re-tokenized answers).

Around each level /metrics is scraped, and the differences of a few counters are kept: the
server's own prompt and cached-prompt token counts and the host-cache (HiCache) hits, where it
has them (absent counters are None, reported as n/a).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from serving.client import RequestRecord, Target, post_stream
from serving.prompts import PromptMaker
from serving.trace import Session

# Counter names (summed over their label sets), first one present wins. The newer names are
# being added beside HiCache; m3serve:cached_tokens_total is the API's older counter.
COUNTERS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("m3serve:prompt_tokens_total", "vllm:prompt_tokens_total"),
    "cached_prompt_tokens": (
        "m3serve:cached_prompt_tokens_total",
        "m3serve:cached_tokens_total",
        "vllm:prefix_cache_hits_total",
    ),
    "hicache_host_hit_tokens": ("m3serve:hicache_host_hit_tokens_total",),
}


@dataclass
class SessionText:
    system: str
    turns: list[str]  # each turn's new user message
    answers: list[str] | None = None  # each turn's assistant message; None: the server's


@dataclass
class TurnResult:
    session: str
    turn: int
    record: RequestRecord


async def session_texts(
    maker: PromptMaker, rng: random.Random, trace: Sequence[Session], trace_answers: bool = False
) -> list[SessionText]:
    """Text of the trace's sizes for every session (its own generator each, drawn up front, so
    the words do not depend on the order the tokenize calls come back in); with
    `trace_answers`, each turn's assistant message too, of the turn's output size."""
    out = []
    for session in trace:
        turns = session.turns
        sizes = [session.system_tokens] + [t.new_tokens for t in turns]
        if trace_answers:
            sizes += [t.output_tokens for t in turns]
        system, *rest = await maker.make_many(random.Random(rng.getrandbits(64)), sizes)
        texts = [t.text for t in rest]
        answers = texts[len(turns) :] if trace_answers else None
        out.append(SessionText(system.text, texts[: len(turns)], answers))
    return out


async def run_session(
    http: httpx.AsyncClient,
    target: Target,
    session: Session,
    text: SessionText,
    results: list[TurnResult],
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": text.system}]
    for k, (turn, context) in enumerate(zip(session.turns, session.contexts, strict=True)):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        messages.append({"role": "user", "content": text.turns[k]})
        record = RequestRecord(start=time.perf_counter(), prompt_text_tokens=context)
        body = target.chat_body(messages, turn.output_tokens)
        results.append(
            TurnResult(session.sid, k, await post_stream(http, target.path, body, record))
        )
        if not record.ok:
            return
        answer = record.text if text.answers is None else text.answers[k]
        messages.append({"role": "assistant", "content": answer})


async def replay(
    url: str,
    headers: dict[str, str],
    timeout: httpx.Timeout,
    target: Target,
    trace: Sequence[Session],
    texts: Sequence[SessionText],
) -> tuple[list[TurnResult], float, float, dict[str, float | None]]:
    """Every session of `trace` at once; (turn results, wall s, client CPU s, counter deltas)."""
    n = len(trace)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    results: list[TurnResult] = []
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        before = await scrape(http)
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(
            *(run_session(http, target, s, t, results) for s, t in zip(trace, texts, strict=True))
        )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = await scrape(http)
    return results, wall, cpu, counter_deltas(before, after)


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of GET /metrics summed by metric name; {} when the server has none."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, names in COUNTERS.items():
        name = next((n for n in names if n in after), None)
        out[key] = None if name is None else after[name] - before.get(name, 0.0)
    return out
