"""The peer reference for the serving benchmark: transformers' eager `generate`, batched.

Loads a checkpoint with transformers' `minimax_m3_vl` implementation (eager attention, the one
that applies the sparse block mask) and times greedy `generate` of `--output-len` new tokens
after `--input-len`-token random prompts at each batch size, in one process and one run. It
reads bf16/fp32 checkpoints only (transformers has no NVFP4 W4A16 path on Hopper), so point it
at a bf16 slice of the same shape as the quantized one the server runs (`m3serve make-tiny
--quant none`). Prints a table and writes JSON; a batch that runs out of memory is reported as
such and ends the sweep.

    python perf/bench_hf_generate.py --model-path /tmp/slice-bf16 --batch 1 16 64 \\
        --input-len 1024 --output-len 256 --out perf/results/hf_generate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch


def load(path: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    )
    return model.to(device).eval()


@torch.inference_mode()
def generate(model: torch.nn.Module, ids: torch.Tensor, new: int) -> float:
    """Wall seconds of one greedy generate of exactly `new` tokens per row."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_batch(model: torch.nn.Module, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    vocab = model.config.text_config.vocab_size - 64  # below MiniMax's special tokens
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, args.input_len), generator=generator).to(args.device)
    generate(model, ids[:, :16], 2)  # warm-up: allocator, kernels
    prefill = generate(model, ids, 1)  # the first token: prefill and one sampling step
    total = generate(model, ids, args.output_len)
    decode = (total - prefill) / max(args.output_len - 1, 1)
    return {
        "batch": batch,
        "ttft_ms": 1e3 * prefill,
        "step_ms": 1e3 * decode,
        "output_tok_s": batch * args.output_len / total,
        "total_s": total,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'batch':>6} {'TTFT ms':>9} {'step ms':>9} {'output tok/s':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch']:>6} {r['error']}")
            continue
        print(f"{r['batch']:>6} {r['ttft_ms']:9.1f} {r['step_ms']:9.2f} {r['output_tok_s']:13.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model = load(args.model_path, getattr(torch, args.dtype), args.device)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        try:
            rows.append(run_batch(model, batch, args))
        except torch.OutOfMemoryError:
            rows.append({"batch": batch, "error": "out of memory"})
            break
    print_table(rows)
    if args.out is not None:
        report = {
            "bench": "hf_generate",
            "model_path": str(args.model_path),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.node(),
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
