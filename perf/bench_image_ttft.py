"""TTFT of a one-image chat request against the same text alone, through a server's streamed
/v1/chat/completions.

Requests go one at a time, alternating text-only and text + image, `--pairs` of each. Every text
is fresh (seeded random words) and every image a fresh random-noise PNG, so neither the prefix
cache nor the image's content hash serves any of it: each TTFT pays for the whole prefill, and
the image request also for its decode, preprocessing, the vision encoder and its placeholder
tokens' prefill. The difference of the medians is what one image adds; `image_tokens` is what
the server counted (prompt tokens with the image minus without).

    python perf/bench_image_ttft.py --url http://127.0.0.1:30000 [--side 672] [--text-tokens 256]
    python perf/bench_image_ttft.py --server-args "--model-path /ckpt"   # starts m3serve here

Prints a table; writes JSON to --out ($OUT/bench_image_ttft.json when $OUT is set, else
perf/results/bench_image_ttft.json).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image
from serving.client import RequestRecord, Target, post_stream
from serving.prompts import PromptMaker
from serving.runner import run_against_server, served_model


def noise_png(rng: np.random.Generator, side: int) -> str:
    """A data: URL of a side x side random RGB PNG (incompressible: the real byte count)."""
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(text: str, image_url: str | None) -> list[dict[str, Any]]:
    if image_url is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
        model = await served_model(http)
        maker = PromptMaker(http, model)
        words = random.Random(args.seed)
        await maker.setup(words)
        texts = await maker.make_many(words, [args.text_tokens] * (2 * args.pairs + 1))
        target = Target("/v1/chat/completions", model, args.output_tokens, True, {})
        records: dict[str, list[RequestRecord]] = {"text": [], "image": []}
        warm = texts.pop()  # first request of the run: not counted
        await post_stream(
            http,
            target.path,
            target.chat_body(messages(warm.text, None)),
            RequestRecord(time.perf_counter(), warm.tokens),
        )
        for i in range(args.pairs):
            for kind, text in (("text", texts[2 * i]), ("image", texts[2 * i + 1])):
                image = noise_png(rng, args.side) if kind == "image" else None
                record = RequestRecord(time.perf_counter(), text.tokens)
                body = target.chat_body(messages(text.text, image))
                records[kind].append(await post_stream(http, target.path, body, record))
    return summarize(args, model, records)


def summarize(
    args: argparse.Namespace, model: str, records: dict[str, list[RequestRecord]]
) -> dict[str, Any]:
    errors = [r.error for rs in records.values() for r in rs if not r.ok]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    ttft = {k: [r.ttft * 1e3 for r in rs] for k, rs in records.items()}
    prompt = {k: statistics.median(r.input_tokens for r in rs) for k, rs in records.items()}
    p50 = {k: statistics.median(v) for k, v in ttft.items()}
    return {
        "benchmark": "bench_image_ttft",
        "model": model,
        "config": {k: getattr(args, k) for k in ("side", "text_tokens", "output_tokens", "pairs")},
        "ttft_ms": ttft,
        "ttft_p50_ms": p50,
        "image_adds_ms": p50["image"] - p50["text"],
        "ratio": p50["image"] / p50["text"],
        "prompt_tokens_p50": prompt,
        "image_tokens": prompt["image"] - prompt["text"],
    }


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    print(
        f"one {c['side']}x{c['side']} image + ~{c['text_tokens']} text tokens vs the text alone,"
        f" {c['pairs']} pairs, model {report['model']}"
    )
    print(f"{'request':>8} {'prompt tok':>11} {'TTFT p50 ms':>12} {'min':>8} {'max':>8}")
    for kind in ("text", "image"):
        values = report["ttft_ms"][kind]
        print(
            f"{kind:>8} {report['prompt_tokens_p50'][kind]:>11.0f} "
            f"{report['ttft_p50_ms'][kind]:>12.1f} {min(values):>8.1f} {max(values):>8.1f}"
        )
    print(
        f"the image adds {report['image_adds_ms']:.1f} ms ({report['ratio']:.2f}x) for "
        f"{report['image_tokens']:.0f} image tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server; else one starts here")
    parser.add_argument("--server-args", default="", help="flags of the m3serve serve started")
    parser.add_argument("--side", type=int, default=672, help="image side, px [672: 576 tokens]")
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.api_key = None
    report, _, _ = run_against_server(args, lambda url: bench(args, url))
    print_table(report)
    out = args.out or (
        Path(os.environ["OUT"]) / "bench_image_ttft.json"
        if "OUT" in os.environ
        else Path(__file__).parent / "results" / "bench_image_ttft.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
