"""How long a tokenizer worker's event loop stops while it encodes a new chat prompt.

The worker that tokenizes a request also detokenizes the outputs of every stream it owns
(actors/tokenizer.py): while its loop encodes a prompt, no stream gets a token. This runs the
worker's own encoder (`PromptEncoder.encode_with_media`, the built-in tiny checkpoint's tokenizer
and chat template) on chat prompts of `--tokens` words each, one after another, beside a ticker
task that yields to the loop and runs again as soon as it can (a busy one: the loop's timers
are too coarse, ~1 ms), once with every prompt encoded inline (the loop's thread) and once
with `THREAD_MIN_CHARS` as served. Per mode: the mean time a prompt took to encode, and the
median and longest of each prompt's stall: the ticker's longest gap while it was encoded (what a
stream's next token could wait on this worker).

    python perf/bench_tokenizer_stall.py [--tokens 1024] [--prompts 50] [--out PATH]

Prints a table; writes JSON to $OUT/bench_tokenizer_stall.json when $OUT is set, else to
perf/results/bench_tokenizer_stall.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from result_json import write_result

from m3serve.actors import prompt
from m3serve.actors.media import MediaPreprocessor
from m3serve.actors.prompt import ModelFacts, PromptEncoder
from m3serve.model.tiny.default import default_model_path
from m3serve.model.vision.processor import DEFAULT_MAX_IMAGE_PIXELS
from m3serve.runtime.messages import GenerateReq

INLINE = 1 << 40  # a threshold no prompt reaches: every prompt encoded on the loop's thread
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "an",
    "at",
    "from",
]


def encoder() -> PromptEncoder:
    """The encoder a tokenizer worker builds (`TokenizerActor`) with its default limits."""
    path = default_model_path()
    media = MediaPreprocessor(path, DEFAULT_MAX_IMAGE_PIXELS)
    encoder = PromptEncoder(ModelFacts.read(path, None), media)
    encoder.load(path)
    return encoder


async def ticker(gaps: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """(time, gap since the last wake-up) for every wake-up until `stop`."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append((now, now - last))
        last = now


async def level(enc: PromptEncoder, texts: list[str], thread_min_chars: int) -> dict[str, Any]:
    prompt.THREAD_MIN_CHARS = thread_min_chars
    gaps: list[tuple[float, float]] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(gaps, stop))
    await asyncio.sleep(0.01)
    spans = []
    for i, text in enumerate(texts):
        req = GenerateReq(rid=str(i), messages=[{"role": "user", "content": text}])
        start = time.perf_counter()
        await enc.encode_with_media(req)
        spans.append((start, time.perf_counter()))
        await asyncio.sleep(0.002)  # prompts arrive apart, as requests do
    stop.set()
    await tick
    # Each prompt's stall: the longest the loop went without running the ticker while (or just
    # after: the wake-up that ends a stall comes after it) the prompt was encoded.
    stalls = [max(g for t, g in gaps if start < t <= end + 0.001) for start, end in spans]
    return {
        "thread_min_chars": thread_min_chars,
        "encode_ms_mean": 1e3 * statistics.mean(end - start for start, end in spans),
        "stall_ms_median": 1e3 * statistics.median(stalls),
        "stall_ms_max": 1e3 * max(stalls),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    enc = encoder()
    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, k=args.tokens)) for _ in range(args.prompts)]
    served = prompt.THREAD_MIN_CHARS
    rows = [await level(enc, texts, mode) for mode in (INLINE, served)]
    prompt.THREAD_MIN_CHARS = served
    return {
        "benchmark": "bench_tokenizer_stall",
        "machine": platform.machine(),
        "prompt_chars": statistics.mean(len(t) for t in texts),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="words per prompt")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(f"chat prompts of {report['prompt_chars']:.0f} chars")
    print("encoded         encode ms   stall median ms   max ms")
    for row in report["rows"]:
        where = "inline" if row["thread_min_chars"] == INLINE else "as served"
        print(
            f"{where:<14} {row['encode_ms_mean']:9.2f} {row['stall_ms_median']:17.2f} "
            f"{row['stall_ms_max']:8.2f}"
        )
    write_result(report, "bench_tokenizer_stall.json", args.out)


if __name__ == "__main__":
    main()
