"""Decode step of an M3.1-shaped slice on the Hopper backend (run on the H200).

Real widths (hidden 6144, 64/4 heads, 128 experts top-4, dense MLP 12288), 4 layers (one dense,
three MoE, all sparse attention), bf16 random weights, `--context` tokens of KV per request.
For batch 1, 8, 32, 64: µs per layer of one decode step eager, replayed from a CUDA graph, and
transformers' eager forward of the same slice (same weight tensors, a KV cache of the same
length); plus kernel launches per layer (torch profiler). Prints a table, writes JSON.

    python perf/bench_decode_slice.py [--context 4096] [--batches 1 8 32 64] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from m3serve.backends.hopper import HopperBackend
from m3serve.core.graphs import DecodeGraphs
from m3serve.model.batch import ForwardBatch
from m3serve.model.config import TextConfig
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SeqStep

LAYERS = 4


def slice_config(vocab: int) -> TextConfig:
    return TextConfig(
        vocab_size=vocab,
        num_layers=LAYERS,
        layer_types=("sparse",) * LAYERS,
        mlp_layer_types=("dense",) + ("moe",) * (LAYERS - 1),
        bos_token_id=None,
        eos_token_ids=(0,),
    )


@torch.no_grad()
def random_model(cfg: TextConfig, device: torch.device) -> M3ForCausalLM:
    model = M3ForCausalLM(cfg, HopperBackend(device), torch.bfloat16, device)
    generator = torch.Generator(device).manual_seed(0)
    for name, param in model.named_parameters():
        fan_in = param.shape[-1]
        if param.ndim == 1:
            param.normal_(0.0, 0.1, generator=generator)
        else:
            param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
        if name.endswith("e_score_correction_bias"):
            param.mul_(0.1)
    return model.eval()


def random_kv(cfg: TextConfig, pages: int, device: torch.device) -> KVCache:
    """A bf16 KV cache of random, not zero, values (zeros can run faster than real data)."""
    kv = KVCache.allocate(cfg, pages, torch.bfloat16, device)
    for layer in kv.layers:
        layer.k.normal_()
        layer.v.normal_()
        if layer.index_k is not None:
            layer.index_k.normal_()
    return kv


def decode_batch(batch_size: int, context: int, page: int, device: torch.device) -> ForwardBatch:
    """`batch_size` decode rows at `context`, each its own token (one token repeated gives the
    rows alike hidden states, routed to the same few experts: fewer expert bytes than a real
    batch reads) and its own pages in a shuffled order."""
    pages_each = -(-(context + 1) // page)
    order = torch.randperm(batch_size * pages_each, generator=torch.Generator().manual_seed(1))
    chunks = []
    for b in range(batch_size):
        pages = order[b * pages_each : (b + 1) * pages_each].tolist()
        chunks.append(SeqStep([7 + b], context, pages))
    return ForwardBatch.build(chunks, page, device)


def time_us(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def launches_per_layer(model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache) -> float:
    layers = model.cfg.num_layers
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            model.hidden_states(batch, kv)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / layers


def hf_step_us(model: M3ForCausalLM, cfg: TextConfig, batch_size: int, context: int) -> float:
    """transformers' eager decode step over the same weights, per layer."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    layers = cfg.num_layers
    hf_cfg = MiniMaxM3VLTextConfig(
        vocab_size=cfg.vocab_size,
        num_hidden_layers=layers,
        layer_types=["minimax_m3_sparse"] * layers,
        mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    )
    hf_cfg._attn_implementation = "eager"
    device = model.device
    with torch.device("meta"):
        hf = MiniMaxM3VLForCausalLM(hf_cfg)
    ours = dict(model.named_parameters())
    hf_params = dict(hf.named_parameters())
    for name in list(hf_params):  # a list: setattr below changes the module's parameters
        tensor = _our_tensor(name, model, ours)
        if tensor is None:
            tensor = torch.zeros_like(hf_params[name], device=device)
        module, attr = name.rsplit(".", 1)
        setattr(hf.get_submodule(module), attr, torch.nn.Parameter(tensor, requires_grad=False))
    for name, buf in list(hf.named_buffers()):
        module, attr = name.rsplit(".", 1)
        value = _our_tensor(name, model, ours)
        if value is None:
            value = torch.zeros_like(buf, device=device) if buf.is_meta else buf.to(device)
        setattr(hf.get_submodule(module), attr, value)
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    hf = hf.to(device).eval()
    cache = DynamicCache(config=hf_cfg)
    shape = (batch_size, cfg.num_kv_heads, context, cfg.head_dim)
    for layer in range(layers):
        k = torch.randn(shape, dtype=torch.bfloat16, device=device)
        cache.update(k, torch.randn_like(k), layer)
        ik = torch.randn(batch_size, 1, context, cfg.index_head_dim, dtype=torch.bfloat16)
        cache.layers[layer].update_index(ik.to(device))
    ids = torch.full((batch_size, 1), 7, device=device)
    positions = torch.full((batch_size, 1), context, device=device)

    def step() -> None:
        with torch.inference_mode():
            hf(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        cache.crop(context)

    return time_us(step) / layers


# transformers' module names -> ours (the layouts are the same; only the names differ), and
# transformers' attention projections -> their rows of our fused qkv_proj.
_QKV = {
    "q_proj": 0,
    "k_proj": 1,
    "v_proj": 2,
    "indexer.q_proj": 3,
    "indexer.k_proj": 4,
}
_RENAMES = (
    (".self_attn.indexer.q_norm", ".self_attn.index_q_norm"),
    (".self_attn.indexer.k_norm", ".self_attn.index_k_norm"),
    (".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
    (".mlp.gate.weight", ".block_sparse_moe.gate.weight"),
    (".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.w13"),
    (".mlp.experts.down_proj", ".block_sparse_moe.experts.w2"),
    (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
)


def _our_tensor(
    hf_name: str, model: M3ForCausalLM, ours: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    attn, _, rest = hf_name.partition(".self_attn.")
    projection = rest.removesuffix(".weight")
    if projection in _QKV:
        module = model.get_submodule(attn + ".self_attn")
        rows = module.splits
        start = sum(rows[: _QKV[projection]])
        return module.qkv_proj.weight[start : start + rows[_QKV[projection]]]
    name = hf_name
    for theirs, mine in _RENAMES:
        name = name.replace(theirs, mine)
    return ours.get(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = slice_config(args.vocab)
    model = random_model(cfg, device)
    page = cfg.page_size
    max_bs = max(args.batches)
    pages = max_bs * (-(-(args.context + 1) // page)) + 1
    kv = random_kv(cfg, pages + 1, device)
    rows = []
    for bs in args.batches:
        batch = decode_batch(bs, args.context, page, device)
        eager = time_us(lambda batch=batch: model.hidden_states(batch, kv)) / LAYERS
        graphs = DecodeGraphs(model, kv, pages, bs, batch.page_table.shape[1])
        graphs.capture()
        graphed = time_us(lambda batch=batch, g=graphs: g.run(batch)) / LAYERS
        row: dict[str, Any] = {
            "batch": bs,
            "context": args.context,
            "eager_us_per_layer": eager,
            "graph_us_per_layer": graphed,
            "launches_per_layer": launches_per_layer(model, batch, kv),
        }
        if not args.no_hf:
            try:
                row["hf_eager_us_per_layer"] = hf_step_us(model, cfg, bs, args.context)
            except torch.OutOfMemoryError:
                row["hf_eager_us_per_layer"] = None
            torch.cuda.empty_cache()
        rows.append(row)
        del graphs
        torch.cuda.empty_cache()
    print(f"M3.1 slice ({LAYERS} layers, real widths, bf16), decode at context {args.context}")
    print(
        f"{'batch':>5} {'eager µs/layer':>15} {'graph µs/layer':>15} {'HF µs/layer':>12} "
        f"{'launch/layer':>12} {'graph vs HF':>11}"
    )
    for r in rows:
        hf = r.get("hf_eager_us_per_layer")
        hf_text = f"{hf:12.0f}" if hf else f"{'-':>12}"
        ratio = f"{hf / r['graph_us_per_layer']:10.1f}x" if hf else f"{'-':>11}"
        print(
            f"{r['batch']:5d} {r['eager_us_per_layer']:15.0f} {r['graph_us_per_layer']:15.0f} "
            f"{hf_text} {r['launches_per_layer']:12.1f} {ratio}"
        )
    out = args.out or Path(os.environ.get("OUT", "perf/results")) / "bench_decode_slice.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "bench_decode_slice", "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
