"""Tokens/s of the reference backend on CPU for the built-in tiny model (a baseline, no target).

Prefill at several prompt lengths and greedy decode at batch 1 and 8, each also timed on
transformers' eager implementation of the same checkpoint in the same run, so the last column is
a ratio from one run. Prints a table and writes JSON.

    python perf/bench_reference.py [--model-path DIR] [--threads N] [--out perf/results/...json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from m3serve.backends.reference import ReferenceBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SeqStep


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best wall time of a few runs (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length * 31 + batch)
    return torch.randint(0, vocab - 64, (batch, length), generator=g).tolist()


@torch.inference_mode()
def ours_prefill(model: M3ForCausalLM, ids: list[list[int]]) -> None:
    page_size = model.cfg.page_size
    per_req = -(-len(ids[0]) // page_size)
    kv = KVCache.allocate(model.cfg, per_req * len(ids), model.dtype, model.device)
    chunks = [
        SeqStep(seq, 0, list(range(i * per_req, (i + 1) * per_req))) for i, seq in enumerate(ids)
    ]
    model(ForwardBatch.build(chunks, page_size, model.device), kv)


@torch.inference_mode()
def ours_decode(model: M3ForCausalLM, ids: list[list[int]], steps: int) -> None:
    """Prefill untimed is not possible inside one call, so this runs prefill + steps decodes."""
    page_size = model.cfg.page_size
    per_req = -(-(len(ids[0]) + steps) // page_size)
    kv = KVCache.allocate(model.cfg, per_req * len(ids), model.dtype, model.device)
    pages = [list(range(i * per_req, (i + 1) * per_req)) for i in range(len(ids))]
    seqs = [list(s) for s in ids]
    news = seqs
    for _ in range(steps + 1):
        starts = [len(s) - len(n) for s, n in zip(seqs, news, strict=True)]
        chunks = [SeqStep(n, st, p) for n, st, p in zip(news, starts, pages, strict=True)]
        logits = model(ForwardBatch.build(chunks, page_size, model.device), kv)
        next_ids = logits.argmax(-1).tolist()
        for seq, token in zip(seqs, next_ids, strict=True):
            seq.append(token)
        news = [[t] for t in next_ids]


@torch.inference_mode()
def hf_prefill(hf: torch.nn.Module, ids: list[list[int]]) -> None:
    hf(input_ids=torch.tensor(ids), logits_to_keep=1)


@torch.inference_mode()
def hf_decode(hf: torch.nn.Module, ids: list[list[int]], steps: int) -> None:
    batch = torch.tensor(ids)
    hf.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=steps + 1,
        min_new_tokens=steps + 1,
        do_sample=False,
    )


def load_hf(path: Path) -> torch.nn.Module | None:
    try:
        from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
    except ImportError:
        return None
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_reference.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(
        args.model_path, ReferenceBackend(torch.device("cpu")), "float32", progress=False
    )
    model = loaded.model
    hf = load_hf(loaded.path)
    vocab, steps = model.cfg.vocab_size, args.decode_steps
    rows = []
    for batch, length in ((1, 64), (1, 256), (1, 1024), (8, 256)):
        ids = prompts(batch, length, vocab)
        ours = timed(lambda ids=ids: ours_prefill(model, ids))
        ref = timed(lambda ids=ids: hf_prefill(hf, ids)) if hf is not None else None
        rows.append(_row("prefill", batch, length, batch * length, ours, ref))
    for batch in (1, 8):
        ids = prompts(batch, 64, vocab)
        # Decode time = (prefill + n decodes) - prefill, for both implementations.
        ours = timed(lambda ids=ids: ours_decode(model, ids, steps)) - timed(
            lambda ids=ids: ours_decode(model, ids, 0)
        )
        ref = None
        if hf is not None:
            ref = timed(lambda ids=ids: hf_decode(hf, ids, steps)) - timed(
                lambda ids=ids: hf_decode(hf, ids, 0)
            )
        rows.append(_row("decode", batch, 64, batch * steps, ours, ref))
    _print(rows, loaded.path, torch.get_num_threads())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "bench_reference",
        "model": str(loaded.path),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def _row(phase: str, batch: int, length: int, tokens: int, ours: float, ref: float | None) -> dict:
    row = {
        "phase": phase,
        "batch": batch,
        "prompt_len": length,
        "tokens": tokens,
        "seconds": ours,
        "tok_per_s": tokens / ours,
        "hf_tok_per_s": None if ref is None else tokens / ref,
    }
    row["vs_hf"] = None if ref is None else ref / ours
    return row


def _print(rows: list[dict], path: Path, threads: int) -> None:
    print(f"reference backend, CPU fp32, {threads} thread(s), model {path.name}")
    header = f"{'phase':8} {'batch':>5} {'prompt':>6} {'tokens':>6} {'tok/s':>10} "
    print(header + f"{'HF tok/s':>10} {'vs HF':>7}")
    for r in rows:
        hf = "-" if r["hf_tok_per_s"] is None else f"{r['hf_tok_per_s']:10.1f}"
        ratio = "-" if r["vs_hf"] is None else f"{r['vs_hf']:6.2f}x"
        print(
            f"{r['phase']:8} {r['batch']:5d} {r['prompt_len']:6d} {r['tokens']:6d} "
            f"{r['tok_per_s']:10.1f} {hf:>10} {ratio:>7}"
        )


if __name__ == "__main__":
    main()
