"""What each part of one M3.1 MoE layer's decode costs on the critical path (run on the H200).

The quantized M3.1-shaped slice of `bench_moe_layer.py` (MXFP8 projections, NVFP4 experts, 128
experts), decode at batch B under CUDA-graph replay. A layer's cost is marginal: the replay of
`--layers` layers minus the replay of half as many, over the difference, so the embedding, the
final norm and the graph's launch are not charged to the layers. Each variant changes one thing
and is timed in the same run:

* served: the layer as the engine runs it;
* serial: the shared expert on the main stream after the routed experts (no side stream);
* routed_first: the side stream as served, but the routed experts queued before the shared
  expert (served: the shared expert first, whose GEMVs fill the GPU and hold back the routed
  experts' first kernel until they drain). An H100, 2026-12-07: no change at batch 1, 8, 64
  (the shared GEMV still started first: the queue order of two graph branches does not decide
  it; perf/results/h100_2026-12-07c_routed_first_table/);
* shared_rows8 / shared_rows16 / shared_rows32: at batch 1-2 the shared expert's two GEMVs
  with 8, 16 or 32 weight rows a program (served: 4, 1536 programs for gate_up, all resident at
  once, so the routed experts' first kernel finds no free slot until they drain); fewer, longer
  programs leave SM slots to the routed experts. Other batches run as served. An H100,
  2026-12-07: 157.3 / 165.0 / 197.4 µs against 161.1 served and 159.4 serial (the routed
  gate_up then started at once, but took the bandwidth the GEMVs gave up; results in
  perf/results/h100_2026-12-07d_shared_rows_floor/);
* no_shared / no_routed / no_moe: the shared expert, the routed experts (the router still
  runs), or the whole MoE block replaced by zeros — what remains is the rest's cost (their
  layers' outputs differ, so past batch 1 the later layers may route to other experts);
* no_pdl: no kernel launched with programmatic dependent launch (what PDL buys where used);
  no_pdl_moe: only the routed experts' kernels without it.

The byte floor is the served layer's weight bytes at the read bandwidth measured in the run,
with the experts the step's own router picked (each row a different token: `decode_batch`).
`--kernels [VARIANT...]` also profiles replays of the layers as those variants run them (the
served ones when none is named; torch.profiler, CUPTI sees the kernels a graph launches) and
prints one layer's kernels in order: each one's µs, and the idle time before it on its stream
(launch latency and dependency waits: what no kernel's speed buys back). A kernel launched with
programmatic dependent launch starts early and waits on the device, so its span holds its
predecessor's tail: `--kernels no_pdl` gives each kernel's own time.

    python perf/bench_moe_layer_parts.py [--layers 4] [--batches 1 8] [--context 4096]
        [--variants VARIANT...] [--rounds N] [--kernels [VARIANT...]]

Prints a table; writes JSON to $OUT/bench_moe_layer_parts.json when $OUT is set, else
perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import triton
from bench_decode_slice import decode_batch, random_kv
from bench_moe_layer import quantized_model, routed_ids, slice_config, weight_bytes_read
from gpu_timing import read_bandwidth
from result_json import write_result

from m3serve.backends.hopper import HopperBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.ffn import DenseMLP, MoE
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM

REPLAYS = 50


@contextlib.contextmanager
def variant(name: str, model: M3ForCausalLM, backend: HopperBackend) -> Iterator[None]:
    """The model's code as `name` changes it, for the duration of the block."""
    forward, moe, side, beside = MoE.forward, HopperBackend.moe, backend._side, backend._beside
    stack = contextlib.ExitStack()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    shared = [m.shared_experts for m in moes]
    try:
        if name == "serial":
            backend._side = None
        elif name == "routed_first":
            backend._beside = _routed_first(backend)  # type: ignore[method-assign]
        elif name.startswith("shared_rows"):
            rows = int(name.removeprefix("shared_rows"))
            for mlp in shared:
                mlp.forward = _shared_rows(mlp, rows)  # type: ignore[method-assign]
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
        backend._beside = beside  # type: ignore[method-assign]
        for mlp in shared:
            mlp.__dict__.pop("forward", None)
        stack.close()


def _routed_first(backend: HopperBackend) -> Any:
    """HopperBackend._beside with `first` (the routed experts) queued before `second`: the
    served `_beside` with its two calls swapped: its side-stream call, captured first, is then
    the routed experts (which stream holds a branch does not matter inside a graph)."""
    served = backend._beside

    def beside(first: Any, second: Any) -> tuple[Any, Any]:
        b, a = served(second, first)
        return a, b

    return beside


def _shared_rows(mlp: DenseMLP, rows: int) -> Any:
    """`mlp`'s forward with its GEMVs (batch 1-2) taking `rows` weight rows a program."""
    from m3serve.kernels.triton.mxfp8_linear import Mxfp8Plan, mxfp8_linear

    block_k = 4096 // rows  # the served tile's 4 KB of codes a K step (4 rows x 1024)

    def linear(x: torch.Tensor, weight: Any) -> torch.Tensor:
        plan = Mxfp8Plan(triton.next_power_of_2(x.shape[0]), rows, block_k, 1, 4, 3, gemv=True)
        return mxfp8_linear(x, weight.codes, weight.scales, plan=plan)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            return DenseMLP.forward(mlp, x)
        gate_up = linear(x, mlp.gate_up_proj.data)
        hidden = mlp.backend.swiglu(gate_up, mlp.cfg.swiglu_alpha, mlp.cfg.swiglu_limit)
        return linear(hidden, mlp.down_proj.data)

    return forward


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


def captured(
    model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layers: list[int]
) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `layers`' decode, compiled outside the capture and replayed once."""

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model.hidden_states(batch, kv, layers)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layers: list[int]) -> float:
    """Median µs of one graph replay of `layers` (back to back, so no host gap is timed)."""
    graph = captured(model, batch, kv, layers)
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


PROFILED_REPLAYS = 20


def kernel_timeline(
    model: M3ForCausalLM, batch: ForwardBatch, kv: KVCache, layers: int
) -> list[dict[str, Any]]:
    """One layer's kernels in launch order, from profiled replays of `layers` layers: name,
    stream, median µs, and median idle µs on its stream before it (since the previous kernel
    there ended). A kernel is matched across replays by (name, stream, occurrence), which the
    side stream's interleaving with the main one does not change."""
    graph = captured(model, batch, kv, list(range(layers)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    per_replay = len(kernels) // PROFILED_REPLAYS
    if per_replay == 0 or len(kernels) % PROFILED_REPLAYS:
        print(f"  (profile: {len(kernels)} kernels for {PROFILED_REPLAYS} replays, no timeline)")
        return []
    samples: dict[tuple[str, Any, int], list[tuple[float, float]]] = {}
    order: list[tuple[str, Any, int]] = []
    for r in range(PROFILED_REPLAYS):
        seen: dict[tuple[str, Any], int] = {}
        last_end: dict[Any, float] = {}
        for k in kernels[r * per_replay : (r + 1) * per_replay]:
            ts, dur, stream = float(k["ts"]), float(k["dur"]), k["tid"]
            n = seen.get((k["name"], stream), 0)
            seen[(k["name"], stream)] = n + 1
            key = (k["name"], stream, n)
            idle = ts - last_end[stream] if stream in last_end else 0.0
            last_end[stream] = ts + dur
            if r == 0:
                order.append(key)
            samples.setdefault(key, []).append((dur, idle))
    lo, hi = _one_layer(order, layers)
    return [
        {
            "name": key[0],
            "stream": key[1],
            "us": statistics.median(d for d, _ in samples[key]),
            "idle_us": statistics.median(i for _, i in samples[key]),
        }
        for key in order[lo:hi]
    ]


def _one_layer(order: list[tuple[str, Any, int]], layers: int) -> tuple[int, int]:
    """[lo, hi) of the second layer's kernels in `order`: a layer starts where the earliest
    name that occurs exactly once per layer occurs."""
    names = [key[0] for key in order]
    for name in names:
        at = [j for j, n in enumerate(names) if n == name]
        if len(at) == layers >= 3:
            return at[1], at[2]
    return 0, len(order)


def print_timeline(bs: int, name: str, rows: list[dict[str, Any]]) -> None:
    busy = sum(r["us"] for r in rows)
    idle = sum(r["idle_us"] for r in rows)
    print(f"\nbatch {bs}, {name}: one layer's kernels ({len(rows)}), µs and idle µs before each")
    for r in rows:
        print(f"  s{r['stream']!s:>3} {r['us']:7.1f} {r['idle_us']:6.1f}  {r['name'][:90]}")
    print(f"  kernel µs {busy:.1f}, idle µs before them {idle:.1f} (all streams)")


VARIANTS = (
    "served",
    "serial",
    "routed_first",
    "shared_rows8",
    "shared_rows16",
    "shared_rows32",
    "no_pdl",
    "no_pdl_moe",
    "no_shared",
    "no_routed",
    "no_moe",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--kernels",
        nargs="*",
        default=None,
        choices=VARIANTS,
        help="print one layer's kernel timeline as these variants run it (none named: served)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every variant this many times, in turn, and tabulate each one's median "
        "(a layer moves 1-2 µs from one timing to the next)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    # The KV cache's values decide the routing, and with it the experts a step reads: unseeded,
    # runs of the same code differed by up to 5 % at batch 64 (2026-12-07).
    torch.manual_seed(0)
    cfg = slice_config(args.layers, 4096)
    backend = HopperBackend(device)
    model = quantized_model(cfg, backend)
    read_bw = read_bandwidth()
    page = cfg.page_size
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[dict[str, Any]]] = {}
    profiled = [] if args.kernels is None else (args.kernels or ["served"])
    for bs in args.batches:
        pages = bs * (-(-(args.context + 1) // page)) + 1
        kv = random_kv(cfg, pages + 1, device)
        batch = decode_batch(bs, args.context, page, device)
        floor = weight_bytes_read(model, routed_ids(model, batch, kv))
        timed: dict[str, list[tuple[float, float]]] = {name: [] for name in args.variants}
        for _ in range(args.rounds):
            for name in args.variants:
                with variant(name, model, backend):
                    per_layer, rest = marginal_us(model, batch, kv, args.layers)
                timed[name].append((per_layer, rest))
                print(f"batch {bs:4d} {name:>13}: {per_layer:8.1f} µs/layer (rest {rest:6.1f} µs)")
        for name, samples in timed.items():
            per_layer_samples = [per for per, _ in samples]
            rows.append(
                {
                    "batch": bs,
                    "variant": name,
                    "us_per_layer": statistics.median(per_layer_samples),
                    "us_outside_layers": statistics.median(rest for _, rest in samples),
                    "us_per_layer_samples": per_layer_samples,
                    "floor_us_per_layer": floor / read_bw * 1e6,
                }
            )
        for name in profiled:
            with variant(name, model, backend):
                timeline = kernel_timeline(model, batch, kv, args.layers)
            print_timeline(bs, name, timeline)
            timelines[f"{bs}/{name}"] = timeline
        del kv
        torch.cuda.empty_cache()
    median = f", the median of {args.rounds} timings" if args.rounds > 1 else ""
    print(f"\nread bandwidth {read_bw / 1e12:.2f} TB/s; µs per MoE layer (marginal{median})")
    print(f"{'variant':>13} " + " ".join(f"{'B=' + str(b):>9}" for b in args.batches))
    for name in args.variants:
        cells = [r["us_per_layer"] for r in rows if r["variant"] == name]
        print(f"{name:>13} " + " ".join(f"{c:9.1f}" for c in cells))
    floors = [next(r["floor_us_per_layer"] for r in rows if r["batch"] == b) for b in args.batches]
    print(f"{'floor':>13} " + " ".join(f"{f:9.1f}" for f in floors))
    report = {
        "benchmark": "bench_moe_layer_parts",
        "read_bandwidth": read_bw,
        "rows": rows,
        "kernel_timelines": timelines,
    }
    write_result(report, "bench_moe_layer_parts.json", args.out)


if __name__ == "__main__":
    main()
