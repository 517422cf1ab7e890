"""Decode step per layer under tensor parallelism, on the GPUs of one node (issue 16's table).

For each `--tp` size in `--tps`, one process per rank (NCCL, one GPU each; gloo on the CPU)
loads its slices of `--model-path` through the loader, as a served rank does, fills a KV cache
of `--context` tokens per row with values seeded by global KV head (so every TP size holds the
same cache), and runs one decode step per batch size in step on every rank: replayed from a
CUDA graph on GPUs, eager on the CPU. Per TP size and batch: µs per layer (rank 0's median
step; collectives keep the ranks in step), the share of the step spent in NCCL kernels (torch
profiler over a few replays: device time of kernels named nccl*, over the step time), and how
many rows' greedy tokens equal those of the first TP size. Prints a table, writes JSON.

    python perf/bench_tp_decode.py --model-path CKPT [--tps 1 2 4] [--batches 1 32 128]
        [--context 4096] [--ep 1] [--device cuda|cpu]

On the CPU (`--device cpu`, the reference backend, gloo) it checks the same path at tiny sizes:
`tests/e2e/test_bench_tp_decode.py` runs it on the built-in tiny checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from result_json import write_result

from m3serve.backends import create_backend
from m3serve.core.graphs import DecodeGraphs
from m3serve.core.rank_join import join_ranks, leave_ranks, rank_device
from m3serve.engine.ranks import rank_addresses
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.parallel import Parallel, RankGroup
from m3serve.runtime.messages import SeqStep

REPLAYS = 30  # timed steps per batch size
PROFILED = 5  # steps under the profiler, for the NCCL share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel groups (<= each tp)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    first: dict[int, list[int]] | None = None
    for tp in args.tps:
        result = run_tp(args, tp)
        first = first or result["tokens"]
        for batch in args.batches:
            tokens, want = result["tokens"][batch], first[batch]
            same = sum(a == b for a, b in zip(tokens, want, strict=True))
            rows.append(
                {
                    "tp": tp,
                    "ep": min(args.ep, tp),
                    "batch": batch,
                    "us_per_layer": result["us"][batch] / result["layers"],
                    "nccl_share": result["nccl"].get(batch),
                    "greedy_equal": f"{same}/{batch}",
                }
            )
    print_table(rows, args)
    meta = {"context": args.context, "device": args.device, "model_path": args.model_path}
    write_result({"rows": rows, **meta}, "bench_tp_decode.json", args.out)


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\ndecode step per layer, context {args.context} ({args.device})")
    same = f"greedy = tp {args.tps[0]}"
    print(f"{'tp':>3} {'ep':>3} {'batch':>6} {'us/layer':>10} {'NCCL %':>7} {same:>14}")
    for r in rows:
        share = "-" if r["nccl_share"] is None else f"{100 * r['nccl_share']:.1f}"
        print(
            f"{r['tp']:>3} {r['ep']:>3} {r['batch']:>6} {r['us_per_layer']:>10.1f} {share:>7} "
            f"{r['greedy_equal']:>14}"
        )


def run_tp(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    """Spawn the `tp` ranks; rank 0's measurements."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        port = rank_addresses(tp)[0].port
        mp.spawn(rank_main, (tp, port, args, out), nprocs=tp, join=True)
        result = torch.load(Path(out) / "rank0.pt", weights_only=False)
    print(f"tp {tp}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return result


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from m3serve.runtime.messages import RankAddress

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the cores
    address = RankAddress(rank, world, port)
    device = rank_device(device, address)
    ranks = join_ranks(address, device) if world > 1 else RankGroup()
    backend_name = "hopper" if device.type == "cuda" else "reference"
    backend = create_backend(backend_name, device)
    parallel = Parallel(ranks, min(args.ep, world))
    model = load_model(args.model_path, backend, progress=False, parallel=parallel).model
    try:
        result = measure(model, parallel, args)
        if rank == 0:
            torch.save(result, Path(out) / "rank0.pt")
    finally:
        if world > 1:
            leave_ranks()


@torch.inference_mode()
def measure(model: M3ForCausalLM, parallel: Parallel, args: argparse.Namespace) -> dict[str, Any]:
    cfg, device = model.cfg, model.device
    page = cfg.page_size
    pages_each = -(-(args.context + 1) // page)
    largest = max(args.batches)
    kv = seeded_kv(model, parallel, largest * pages_each + 1)
    graphs = None
    if device.type == "cuda":
        graphs = DecodeGraphs(model, kv, largest * pages_each, largest, pages_each)
        graphs.sizes = sorted(set(args.batches))
        graphs.capture()
    us, nccl, tokens = {}, {}, {}
    for batch_size in args.batches:
        batch = decode_batch(batch_size, args.context, page, pages_each, device)

        def step(batch: ForwardBatch = batch) -> torch.Tensor:
            if graphs is not None:
                return graphs.run(batch)
            return model.compute_logits(model.hidden_states(batch, kv))

        tokens[batch_size] = step().argmax(-1).tolist()
        us[batch_size] = median_step_us(step, device)
        if device.type == "cuda":
            nccl[batch_size] = nccl_share(step, us[batch_size])
    return {"us": us, "nccl": nccl, "tokens": tokens, "layers": cfg.num_layers}


def seeded_kv(model: M3ForCausalLM, parallel: Parallel, pages: int) -> KVCache:
    """A KV cache of random values drawn per global KV head (the same cache at every TP size:
    a rank keeps the heads it holds)."""
    cfg = model.cfg
    heads = parallel.kv_heads(cfg)
    kv = KVCache.allocate(cfg, pages, model.dtype, model.device, model.kv_heads)
    for i, layer in enumerate(kv.layers):
        for j, tensor in enumerate((layer.k, layer.v)):
            for local, head in enumerate(range(heads.start, heads.stop)):
                tensor[:, local] = _normal(tensor[:, local], 1000 * i + 10 * j + head)
        if layer.index_k is not None:  # one shared index-K head, the same on every rank
            layer.index_k.copy_(_normal(layer.index_k, 1000 * i + 7))
    return kv


def _normal(like: torch.Tensor, seed: int) -> torch.Tensor:
    """Standard normal values of `like`'s shape from `seed`, drawn into a fresh contiguous
    tensor (a strided view would draw another sequence: the CPU fills contiguous tensors in
    vectorized blocks)."""
    generator = torch.Generator(like.device).manual_seed(seed)
    values = torch.randn(like.shape, generator=generator, device=like.device)
    return values.to(like.dtype)


def decode_batch(
    batch_size: int, context: int, page: int, pages_each: int, device: torch.device
) -> ForwardBatch:
    """`batch_size` decode rows of `context` tokens each, over disjoint pages; row b's token
    differs by row, so rows route to different experts."""
    seqs = [
        SeqStep([7 + b], context, list(range(b * pages_each, (b + 1) * pages_each)))
        for b in range(batch_size)
    ]
    return ForwardBatch.build(seqs, page, device)


def median_step_us(step: Any, device: torch.device) -> float:
    times = []
    for _ in range(REPLAYS):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(1e6 * (time.perf_counter() - started))
    return statistics.median(times)


def nccl_share(step: Any, step_us: float) -> float:
    """Device time in NCCL kernels per step, over the step's time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.events() if e.device_type == cuda and "nccl" in e.name.lower()]
    per_step = sum(e.time_range.elapsed_us() for e in kernels) / PROFILED
    return per_step / step_us


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
