"""What each part of one M3.1 MoE layer's decode costs on the critical path (run on the H200).

The quantized M3.1-shaped slice of `bench_moe_layer.py` (MXFP8 projections, NVFP4 experts, 128
experts), decode at batch B under CUDA-graph replay. A layer's cost is marginal: the replay of
`--layers` layers minus the replay of half as many, over the difference, so the embedding, the
final norm and the graph's launch are not charged to the layers. Each variant changes one thing
and is timed in the same run:

* served: the layer as the engine runs it;
* serial: the shared expert on the main stream after the routed experts (no side stream);
* no_shared / no_routed / no_moe: the shared expert, the routed experts (the router still
  runs), or the whole MoE block replaced by zeros — what remains is the rest's cost;
* no_pdl: no kernel launched with programmatic dependent launch (what PDL buys where used);
  no_pdl_moe: only the routed experts' kernels without it.

The byte floor is the served layer's weight bytes at the read bandwidth measured in the run.

    python perf/bench_moe_layer_parts.py [--layers 4] [--batches 1 8] [--context 4096]

Prints a table; writes JSON to $OUT/bench_moe_layer_parts.json when $OUT is set, else
perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from bench_decode_slice import decode_batch, random_kv
from bench_moe_layer import quantized_model, slice_config, weight_bytes_read
from gpu_timing import read_bandwidth
from result_json import write_result

from m3serve.backends.hopper import HopperBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.ffn import MoE
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM

REPLAYS = 50


@contextlib.contextmanager
def variant(name: str, model: M3ForCausalLM, backend: HopperBackend) -> Iterator[None]:
    """The model's code as `name` changes it, for the duration of the block."""
    forward, moe, side = MoE.forward, HopperBackend.moe, backend._side
    stack = contextlib.ExitStack()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    shared = [m.shared_experts for m in moes]
    try:
        if name == "serial":
            backend._side = None
        elif name == "no_moe":
            MoE.forward = lambda self, x: torch.zeros_like(x)  # type: ignore[method-assign]
        elif name == "no_routed":
            HopperBackend.moe = _route_only  # type: ignore[method-assign]
        elif name == "no_shared":
            for mlp in shared:
                mlp.forward = torch.zeros_like  # type: ignore[method-assign]
        elif name in ("no_pdl", "no_pdl_moe"):
            stack.enter_context(_pdl_off(moe_only=name == "no_pdl_moe"))
        yield
    finally:
        MoE.forward, HopperBackend.moe, backend._side = forward, moe, side  # type: ignore[method-assign]
        for mlp in shared:
            mlp.__dict__.pop("forward", None)
        stack.close()


@contextlib.contextmanager
def _pdl_off(moe_only: bool) -> Iterator[None]:
    """Every kernel launcher's PDL check answers no (or only the routed experts')."""
    from m3serve.kernels.triton import mxfp8_linear, nvfp4_moe, router
    from m3serve.kernels.triton.attention import decode

    modules = (nvfp4_moe,) if moe_only else (decode, router, nvfp4_moe)
    saved = [m.pdl_supported for m in modules], mxfp8_linear._sm90
    try:
        for m in modules:
            m.pdl_supported = lambda *a, **k: False  # type: ignore[assignment]
        if not moe_only:
            mxfp8_linear._sm90 = lambda *a, **k: False  # type: ignore[assignment]
        yield
    finally:
        for m, f in zip(modules, saved[0], strict=True):
            m.pdl_supported = f  # type: ignore[assignment]
        mxfp8_linear._sm90 = saved[1]  # type: ignore[assignment]


def _route_only(
    self: HopperBackend, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *args: Any, **kw: Any
) -> torch.Tensor:
    """HopperBackend.moe without the routed experts: the router and the shared expert run."""
    self._router.route(x, w, b, args[1], args[4])
    shared = kw.get("shared")
    return torch.zeros_like(x) if shared is None else shared()


def replay_us(model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layers: list[int]) -> float:
    """Median µs of one graph replay of `layers` (back to back, so no host gap is timed)."""

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model.hidden_states(batch, kv, layers)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / REPLAYS)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(samples)


def marginal_us(
    model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layers: int
) -> tuple[float, float]:
    """(µs per layer, µs of the rest): from replays of all layers and of half of them."""
    full = replay_us(model, batch, kv, list(range(layers)))
    half = replay_us(model, batch, kv, list(range(layers // 2)))
    per_layer = (full - half) / (layers - layers // 2)
    return per_layer, full - layers * per_layer


VARIANTS = ("served", "serial", "no_pdl", "no_pdl_moe", "no_shared", "no_routed", "no_moe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = slice_config(args.layers, 4096)
    backend = HopperBackend(device)
    model = quantized_model(cfg, backend)
    read_bw = read_bandwidth()
    page = cfg.page_size
    rows: list[dict[str, Any]] = []
    for bs in args.batches:
        pages = bs * (-(-(args.context + 1) // page)) + 1
        kv = random_kv(cfg, pages + 1, device)
        batch = decode_batch(bs, args.context, page, device)
        floor = weight_bytes_read(model, torch.randn(bs, cfg.hidden_size, device=device))
        for name in args.variants:
            with variant(name, model, backend):
                per_layer, rest = marginal_us(model, batch, kv, args.layers)
            rows.append(
                {
                    "batch": bs,
                    "variant": name,
                    "us_per_layer": per_layer,
                    "us_outside_layers": rest,
                    "floor_us_per_layer": floor / read_bw * 1e6,
                }
            )
            print(f"batch {bs:4d} {name:>13}: {per_layer:8.1f} µs/layer (rest {rest:6.1f} µs)")
        del kv
        torch.cuda.empty_cache()
    print(f"\nread bandwidth {read_bw / 1e12:.2f} TB/s; µs per MoE layer (marginal)")
    print(f"{'variant':>13} " + " ".join(f"{'B=' + str(b):>9}" for b in args.batches))
    for name in args.variants:
        cells = [r["us_per_layer"] for r in rows if r["variant"] == name]
        print(f"{name:>13} " + " ".join(f"{c:9.1f}" for c in cells))
    floors = [next(r["floor_us_per_layer"] for r in rows if r["batch"] == b) for b in args.batches]
    print(f"{'floor':>13} " + " ".join(f"{f:9.1f}" for f in floors))
    report = {"benchmark": "bench_moe_layer_parts", "read_bandwidth": read_bw, "rows": rows}
    write_result(report, "bench_moe_layer_parts.json", args.out)


if __name__ == "__main__":
    main()
