"""One MoE layer's decode on the Hopper backend with the weights as M3.1 stores them (MXFP8
projections, NVFP4 experts), against the same layer in bf16 and transformers eager (run on the
H200).

An M3.1-shaped slice of `--layers` MoE layers (hidden 6144, 64/4 heads, head 128, indexer 4×128,
128 experts × 3072 top-4, shared expert 3072, page 128, top-16 blocks), random valid quantized
weights; the bf16 slice holds exactly their dequantized values, so the two compute the same
function. Per decode step at batch 1..128 under CUDA-graph replay: µs per layer for both, and the
quantized layer's byte floor — the weight bytes a step reads (q/k/v/indexer + o projections,
router, shared expert, and the distinct experts the step's router picked) over the read
bandwidth measured in the same run. Also the difference between the two slices' hidden states
(bf16 rounding, and an expert pick flipped where two scores nearly tie: the tokens whose own
difference passes 5e-2 are counted) and transformers' eager step on the bf16 weights.

    python perf/bench_moe_layer.py [--layers 2] [--context 4096] [--batches 1 8 32 64 128]
        [--no-hf]

Prints a table; writes JSON to $OUT/bench_moe_layer.json when $OUT is set, else perf/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from bench_decode_slice import decode_batch, hf_step_us, random_kv
from gpu_timing import eager_us, read_bandwidth

from m3serve.backends.hopper import HopperBackend
from m3serve.backends.reference import dequant_experts
from m3serve.core.graphs import DecodeGraphs
from m3serve.kernels.quant import dequant_mxfp8
from m3serve.model.batch import ForwardBatch
from m3serve.model.config import QuantConfig, TextConfig
from m3serve.model.ffn import Experts
from m3serve.model.inventory import text_inventory
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.params import Linear
from m3serve.model.weights import WeightFormats


def slice_config(layers: int, vocab: int) -> TextConfig:
    return TextConfig(
        vocab_size=vocab,
        num_layers=layers,
        layer_types=("sparse",) * layers,
        mlp_layer_types=("moe",) * layers,
        bos_token_id=None,
        eos_token_ids=(0,),
    )


def mixed_precision(cfg: TextConfig) -> QuantConfig:
    """The checkpoint's formats: NVFP4 routed experts, MXFP8 every other projection."""
    layers = {
        s.module: "NVFP4" if ".experts." in s.module else "MXFP8"
        for s in text_inventory(cfg, "")
        if s.kind == "linear"
    }
    return QuantConfig("modelopt", "MIXED_PRECISION", layers)


@torch.no_grad()
def quantized_model(cfg: TextConfig, backend: HopperBackend) -> M3ForCausalLM:
    """Random weights of O(1/sqrt(fan_in)), every code and scale a valid one."""
    device = backend.device
    formats = WeightFormats(mixed_precision(cfg), backend.weight_formats)
    model = M3ForCausalLM(cfg, backend, torch.bfloat16, device, formats)
    gen = torch.Generator(device).manual_seed(0)
    for module in model.modules():
        if isinstance(module, Linear) and module.fmt == "MXFP8":
            fan_in = module.weight.shape[1]
            codes = torch.randn(module.weight.shape, device=device, generator=gen) * 16
            module.weight.copy_(codes.to(torch.float8_e4m3fn))
            # 16 * 2**(e - 127) = 1 / sqrt(fan_in)
            module.weight_scale.fill_(127 - 4 - round(math.log2(math.sqrt(fan_in))))
        elif isinstance(module, Experts) and module.fmt == "NVFP4":
            _random_nvfp4(module, gen)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != torch.float8_e4m3fn:
            if name.endswith(("_global", "weight_scale")) or ".experts." in name:
                continue
            fan_in = param.shape[-1]
            std = 0.1 if param.ndim == 1 else 1.0 / math.sqrt(fan_in)
            param.normal_(0.0, std, generator=gen)
    backend.prepare_weights(model)  # as load_model does: the layouts the kernels read
    return model.eval()


def _random_nvfp4(experts: Experts, gen: torch.Generator) -> None:
    for codes in (experts.w13, experts.w2):
        codes.copy_(torch.randint(0, 256, codes.shape, device=codes.device, generator=gen))
    for scale in (experts.w13_scale, experts.w2_scale):
        unit = torch.rand(scale.shape, device=scale.device, generator=gen) + 0.5
        scale.copy_(unit.to(torch.float8_e4m3fn))
    # E2M1 codes have RMS ~3, so a row of K of them sums to ~3 sqrt(K): scale that back to O(1).
    experts.w13_global.fill_(1.0 / (3.0 * math.sqrt(2 * experts.w13.shape[2])))
    experts.w2_global.fill_(1.0 / (3.0 * math.sqrt(2 * experts.w2.shape[2])))


@torch.no_grad()
def dequantized_model(quantized: M3ForCausalLM, cfg: TextConfig) -> M3ForCausalLM:
    """The same slice with every weight dense in bf16 (the path without quantized kernels)."""
    device = quantized.device
    dense = M3ForCausalLM(cfg, HopperBackend(device, "torch"), torch.bfloat16, device)
    ours = dict(dense.named_parameters())
    for name, module in quantized.named_modules():
        if isinstance(module, Linear):
            value = module.weight
            if module.fmt == "MXFP8":
                value = dequant_mxfp8(module.weight, module.weight_scale)
            ours[f"{name}.weight"].copy_(value)
        elif isinstance(module, Experts):
            values = dequant_experts(module.data, torch.bfloat16)  # type: ignore[arg-type]
            ours[f"{name}.w13"].copy_(values.w13)
            ours[f"{name}.w2"].copy_(values.w2)
    for name, param in quantized.named_parameters():
        plain = param.is_floating_point() and param.dtype != torch.float8_e4m3fn
        if plain and name in ours and ours[name].shape == param.shape:
            ours[name].copy_(param)
    return dense.eval()


@contextlib.contextmanager
def watched_routes() -> Iterator[list[torch.Tensor]]:
    """The expert ids the hopper backend's Triton router picks inside the block, a call each."""
    from m3serve.kernels.triton import router

    picks: list[torch.Tensor] = []
    route = router.route

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(*args, **kwargs)
        picks.append(ids.clone())
        return weights, ids

    router.route = spy  # type: ignore[assignment]
    try:
        yield picks
    finally:
        router.route = route  # type: ignore[assignment]


def routed_ids(model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache) -> list[torch.Tensor]:
    """The expert ids each MoE layer's router picks in one eager step of `batch`."""
    with torch.inference_mode(), watched_routes() as picks:
        model.hidden_states(batch, kv)
    if len(picks) != model.cfg.num_layers:
        raise RuntimeError(f"{len(picks)} routings watched for {model.cfg.num_layers} layers")
    return picks


def weight_bytes_read(model: M3ForCausalLM, picks: list[torch.Tensor]) -> float:
    """Bytes of weights one step reads per layer (averaged): every projection, the router, the
    shared expert and the distinct experts the step's router picked (`watched_routes`)."""
    total = 0.0
    layers = list(model.model.layers)
    for layer, ids in zip(layers, picks, strict=True):
        moe = layer.block_sparse_moe
        dense_bytes = sum(
            p.nbytes for n, p in layer.named_parameters() if ".experts." not in f".{n}"
        )
        distinct = int(ids.unique().numel())
        per_expert = sum(p.nbytes for p in moe.experts.parameters()) / moe.cfg.num_experts
        total += dense_bytes + distinct * per_expert
    return total / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)  # the KV cache's values: a rerun meets the same routing near-ties
    cfg = slice_config(args.layers, args.vocab)
    quantized = quantized_model(cfg, HopperBackend(device))
    dense = dequantized_model(quantized, cfg)
    read_bw = read_bandwidth()
    page = cfg.page_size
    pages = max(args.batches) * (-(-(args.context + 1) // page)) + 1
    kv = random_kv(cfg, pages + 1, device)
    rows = []
    for bs in args.batches:
        batch = decode_batch(bs, args.context, page, device)
        row: dict[str, Any] = {"batch": bs, "context": args.context}
        hidden, routes = {}, {}
        for label, model in (("quantized", quantized), ("bf16", dense)):
            graphs = DecodeGraphs(model, kv, pages, bs, batch.page_table.shape[1])
            graphs.capture()
            # A replay per call, as the engine's decode step runs (metadata copy + replay).
            row[f"{label}_us_per_layer"] = (
                eager_us(lambda g=graphs, b=batch: g.run(b)) / args.layers
            )
            with torch.inference_mode(), watched_routes() as routes[label]:
                hidden[label] = model.hidden_states(batch, kv).float()
            del graphs
            torch.cuda.empty_cache()
        floor_bytes = weight_bytes_read(quantized, routes["quantized"])
        row["weight_bytes_per_layer"] = floor_bytes
        row["floor_us_per_layer"] = floor_bytes / read_bw * 1e6
        row["floor_fraction"] = row["floor_us_per_layer"] / row["quantized_us_per_layer"]
        diff = (hidden["quantized"] - hidden["bf16"]).norm() / hidden["bf16"].norm()
        row["relative_difference"] = float(diff)
        # Per token: one expert pick flipped by a near-tie moves its token's output wholly,
        # rounding alone moves every token a little.
        per_token = (hidden["quantized"] - hidden["bf16"]).norm(dim=-1)
        per_token = per_token / hidden["bf16"].norm(dim=-1)
        row["token_relative_differences"] = per_token.tolist()
        if not args.no_hf:
            try:
                row["hf_eager_us_per_layer"] = hf_step_us(dense, cfg, bs, args.context)
            except torch.OutOfMemoryError:
                row["hf_eager_us_per_layer"] = None
            torch.cuda.empty_cache()
        rows.append(row)
    print(
        f"M3.1 MoE layer ({args.layers} layers, real widths), decode at context {args.context}; "
        f"read bandwidth {read_bw / 1e12:.2f} TB/s"
    )
    print(
        f"{'batch':>5} {'quantized µs':>12} {'floor µs':>9} {'%floor':>7} {'bf16 µs':>8} "
        f"{'×bf16':>6} {'HF µs':>8} {'×HF':>6} {'rel diff':>9} {'tokens > 5e-2':>13}"
    )
    for r in rows:
        q = r["quantized_us_per_layer"]
        hf = r.get("hf_eager_us_per_layer")
        hf_text = f"{hf:8.0f} {hf / q:5.1f}x" if hf else f"{'-':>8} {'-':>6}"
        print(
            f"{r['batch']:5d} {q:12.1f} {r['floor_us_per_layer']:9.1f} "
            f"{100 * r['floor_fraction']:6.1f}% {r['bf16_us_per_layer']:8.1f} "
            f"{r['bf16_us_per_layer'] / q:5.2f}x {hf_text} {r['relative_difference']:9.2e} "
            f"{sum(d > 5e-2 for d in r['token_relative_differences']):6d}/{r['batch']}"
        )
    out = args.out or Path(os.environ.get("OUT", "perf/results")) / "bench_moe_layer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "bench_moe_layer", "read_bandwidth": read_bw, "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
