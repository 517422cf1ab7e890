"""Greedy completions of a fixed set of prompts from a running server, and the comparison of two
such runs: how a --tp N server is checked against --tp 1 on the same checkpoint (issue 16).

    python perf/greedy_probe.py --url http://127.0.0.1:30000 --out tp4.json [--max-tokens 32]
    python perf/greedy_probe.py --compare tp1.json tp4.json

The prompts are token ids below 448 (ordinary tokens of any vocabulary of 512 or more, the tiny
checkpoints' included) of a few lengths up to 1K, so prefill chunks and sparse block selection
both take part. `--compare` prints, per prompt, the first
output token where the runs part and exits 1 when any does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

LENGTHS = (7, 100, 333, 1000)
USABLE = 448  # the tiny vocabulary of 512 less MiniMax's 64 special tokens at its top


def prompts() -> list[list[int]]:
    return [[(17 + 7919 * (i + n)) % USABLE for i in range(n)] for n in LENGTHS]


def probe(url: str, max_tokens: int) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600.0) as client:
        models = client.get("/v1/models").json()["data"]
        model = models[0]["id"]
        outputs = []
        for ids in prompts():
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
            }
            reply = client.post("/v1/completions", json=body)
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            outputs.append({"prompt_len": len(ids), "tokens": choice["logprobs"]["tokens"]})
    return {"url": url, "model": model, "outputs": outputs}


def compare(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Print where each prompt's outputs part; True when none does."""
    same = True
    for a, b in zip(first["outputs"], second["outputs"], strict=True):
        split = next(
            (i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)) if x != y),
            None,
        )
        if split is None and len(a["tokens"]) != len(b["tokens"]):
            split = min(len(a["tokens"]), len(b["tokens"]))
        where = "equal" if split is None else f"differ from output token {split}"
        print(f"prompt of {a['prompt_len']:>5} tokens: {len(a['tokens'])} tokens, {where}")
        same = same and split is None
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("FIRST", "SECOND"))
    args = parser.parse_args()
    if args.compare:
        first, second = (json.loads(p.read_text()) for p in args.compare)
        sys.exit(0 if compare(first, second) else 1)
    if not args.url or not args.out:
        parser.error("--url and --out, or --compare")
    result = probe(args.url, args.max_tokens)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
