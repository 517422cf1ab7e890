"""Sparse decode attention (Triton) on the GPU: time vs the bandwidth floor and vs dense attention.

Real shapes (Hq 64, Hkv 4, D 128, page 128, top-16 pages incl. the local one, 4 index heads over
one 128-wide index-K head), one decode token per request at 8K, 32K and 128K context, batch 1 and
32. Two measurements per point:

* attention: `paged_attention` alone with random selections (bf16 KV), timed as CUDA-graph replay
  (the engine's decode mode) and eagerly (triton.testing.do_bench: L2 flushed, host launch cost
  included); its floor is the selected K/V pages + q + out;
* MSA decode: the whole sparse step of one layer — indexer page scores over the context, block
  top-k, then sparse attention over the chosen pages — for bf16 and fp8_e4m3 caches (KV and
  index-K share the dtype, as in the engine); its floor adds the index-K the indexer scans and
  the score round trip.

Floors are bytes / bandwidth measured in the same run, two ways: the issue's definition (a large
device-to-device copy, read + write bytes counted) and a stricter one (a Triton kernel that only
reads, which reaches more of HBM's bandwidth than a copy). Dense: the same tokens attending to
their whole bf16 context, with torch SDPA (flash, the GQA group folded into the query length) and
with this module's dense path. At batch 1 the step moves only a few MB and is latency-bound; the
run also times an empty kernel in a graph, the per-launch cost the floors leave out.

Graph replays rotate through several input sets (queries, selections, outputs) so repeated calls do
not find their pages in L2 (50 MB on H200); at 8K the whole context fits L2 anyway.

Also: a small config sweep at 128K (block sizes, stages, warps, split targets) to guide tuning,
and a 2K-token prefill chunk at 64K (sparse and dense). Issue targets: ≥ 10× faster than dense at
128K and ≥ 60 % of the bandwidth floor.

    python perf/bench_sparse_attention.py [--contexts 8192,32768,131072] [--batches 1,32]
        [--no-sweep] [--no-prefill] [--out PATH]

Prints a table; writes JSON to $OUT/bench_sparse_attention.json when $OUT is set, else to
perf/results/bench_sparse_attention.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from gpu_timing import copy_bandwidth, eager_us, graph_us, launch_us, read_bandwidth
from result_json import write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

from m3serve.kernels.triton.attention import (
    DEFAULT_CONFIG,
    AttentionConfig,
    decode_num_splits,
    paged_attention,
)
from m3serve.kernels.triton.indexer import index_topk

NUM_Q, NUM_KV, NUM_IDX, HEAD_DIM, PAGE, TOPK = 64, 4, 4, 128, 128, 16
GROUP = NUM_Q // NUM_KV
SCALE = HEAD_DIM**-0.5
L2_BYTES = 50 * 2**20


# --------------------------------------------------------------------------------- inputs


class Context:
    """One bf16 KV cache holding `batch` requests of `max_ctx` tokens (request b owns pages
    [b·n, (b+1)·n) in order), shared by every measured point."""

    def __init__(self, batch: int, max_ctx: int) -> None:
        self.pages_per_req = max_ctx // PAGE
        slots = batch * max_ctx
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.k = torch.empty(slots, NUM_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.v = torch.empty_like(self.k)
        self.index_k = torch.empty(slots, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for t in (self.k, self.v, self.index_k):  # in slices: no fp32 temporary of cache size
            for part in t.split(2**18):
                part.copy_(torch.randn(part.shape, device="cuda", generator=gen))
        fp8 = torch.float8_e4m3fn
        self.fp8 = {"k": self.k.to(fp8), "v": self.v.to(fp8), "index_k": self.index_k.to(fp8)}
        self.max_ctx = max_ctx

    def caches(self, dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if dtype == "fp8_e4m3":
            return self.fp8["k"], self.fp8["v"], self.fp8["index_k"]
        return self.k, self.v, self.index_k

    def table(self, batch: int, ctx: int) -> torch.Tensor:
        first = torch.arange(batch, device="cuda")[:, None] * self.pages_per_req
        return (first + torch.arange(ctx // PAGE, device="cuda")[None, :]).to(torch.int32)

    def dense_kv(self, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, ctx, D] views of the first ctx tokens of each request."""
        shape = (-1, self.max_ctx, NUM_KV, HEAD_DIM)
        k = self.k.view(shape)[:batch, :ctx].permute(0, 2, 1, 3)
        v = self.v.view(shape)[:batch, :ctx].permute(0, 2, 1, 3)
        return k, v


def selection(positions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[T, NUM_IDX, TOPK]: the local page plus 15 random distinct earlier pages."""
    local = positions // PAGE
    blocks = int(local.max()) + 1
    score = torch.rand(positions.shape[0], NUM_IDX, blocks, device="cuda", generator=gen)
    earlier = torch.arange(blocks, device="cuda")[None, None, :] < local[:, None, None]
    vals, idx = torch.where(earlier, score, -1.0).topk(TOPK - 1, dim=-1)
    idx = torch.where(vals >= 0, idx, -1)
    return torch.cat([local[:, None, None].expand(-1, NUM_IDX, 1), idx], -1).to(torch.int32)


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    out: torch.Tensor
    block_ids: torch.Tensor


def decode_steps(
    batch: int, ctx: int, count: int, seed: int
) -> tuple[list[Step], dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
    meta = {
        "positions": positions,
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        "starts": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
    }
    steps = []
    for _ in range(count):
        q = torch.randn(batch, NUM_Q, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        steps.append(Step(q, torch.empty_like(q), selection(positions, gen)))
    return steps, meta


# --------------------------------------------------------------------------------- benchmark


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    copy: float  # bytes/s, read + write bytes of a device copy (the floor)
    read: float  # bytes/s of a read-only stream

    def floors(self, nbytes: float) -> dict[str, float]:
        return {"floor_us": nbytes / self.copy * 1e6, "read_floor_us": nbytes / self.read * 1e6}


def decode_point(
    kv: Context, batch: int, ctx: int, bandwidth: Bandwidth, config: AttentionConfig | None = None
) -> dict[str, float | int]:
    selected_bytes = batch * NUM_KV * TOPK * PAGE * HEAD_DIM * 2 * 2
    # Enough distinct steps that their selected pages overflow L2 between visits.
    sets = max(1, min(32, -(-3 * L2_BYTES // selected_bytes)))
    steps, meta = decode_steps(batch, ctx, sets, seed=ctx + batch)
    table = kv.table(batch, ctx)

    def sparse(step: Step, ids: bool = True) -> Callable[[], object]:
        return lambda: paged_attention(
            step.q, kv.k, kv.v, table, meta["seq_lens"], meta["starts"], meta["positions"],
            PAGE, SCALE, step.block_ids if ids else None, 1, out=step.out, config=config,
        )  # fmt: skip

    row: dict[str, float | int] = {"context": ctx, "batch": batch}
    row["sparse_graph_us"] = graph_us([sparse(s) for s in steps])
    row["sparse_eager_us"] = eager_us(sparse(steps[0]))
    io_bytes = 2 * batch * NUM_Q * HEAD_DIM * 2
    row.update(bandwidth.floors(selected_bytes + io_bytes))
    row["floor_fraction"] = row["floor_us"] / row["sparse_graph_us"]
    row["read_floor_fraction"] = row["read_floor_us"] / row["sparse_graph_us"]
    row["splits"] = decode_num_splits(
        batch, NUM_KV, TOPK * -(-PAGE // (config or DEFAULT_CONFIG).decode_block_n),
        torch.device("cuda"), config or DEFAULT_CONFIG,
    )  # fmt: skip
    if config is not None:  # sweep points time the sparse kernel only
        return row

    k_dense, v_dense = kv.dense_kv(batch, ctx)
    q_views = [s.q.view(batch, NUM_KV, GROUP, HEAD_DIM) for s in steps[:4]]

    def sdpa(q: torch.Tensor) -> Callable[[], object]:
        # The token sees its whole context, so no mask: the GQA group rides in the query length.
        return lambda: F.scaled_dot_product_attention(q, k_dense, v_dense, scale=SCALE)

    # Fused kernels only: the math fallback would materialize [B, H, 16, ctx] scores.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        try:
            reference = sdpa(q_views[0])()
        except RuntimeError:  # a fused kernel refusing the strided views: give it dense copies
            k_dense, v_dense = k_dense.contiguous(), v_dense.contiguous()
            reference = sdpa(q_views[0])()
        row["sdpa_dense_us"] = graph_us([sdpa(q) for q in q_views])
    reference = reference.reshape(batch, NUM_Q, HEAD_DIM)
    row["triton_dense_us"] = graph_us([sparse(s, ids=False) for s in steps[:4]])
    sparse(steps[0], ids=False)()
    err = (steps[0].out.float() - reference.float()).norm() / reference.float().norm()
    row["dense_paths_rel_diff"] = float(err)  # sanity: both dense timings compute the same thing
    dense_bytes = batch * NUM_KV * ctx * HEAD_DIM * 2 * 2 + io_bytes
    row["dense_floor_us"] = dense_bytes / bandwidth.copy * 1e6
    row["speedup_vs_sdpa"] = row["sdpa_dense_us"] / row["sparse_graph_us"]
    row["speedup_vs_triton_dense"] = row["triton_dense_us"] / row["sparse_graph_us"]
    return row


@dataclasses.dataclass
class MsaStep:
    q: torch.Tensor  # [B, Hq, D]
    index_q: torch.Tensor  # [B, H_idx, D]
    scores: torch.Tensor  # [B, H_idx, blocks] fp32
    block_ids: torch.Tensor  # [B, H_idx, TOPK] int32
    out: torch.Tensor


def msa_point(
    kv: Context, batch: int, ctx: int, bandwidth: Bandwidth, dtype: str, dense_us: float
) -> dict[str, float | int | str]:
    """Indexer scores + block top-k + sparse attention for one decode token per request."""
    k_cache, v_cache, index_k = kv.caches(dtype)
    itemsize = k_cache.element_size()
    blocks = ctx // PAGE
    index_bytes = batch * ctx * HEAD_DIM * itemsize
    selected_bytes = batch * NUM_KV * TOPK * PAGE * HEAD_DIM * 2 * itemsize
    score_bytes = 2 * batch * NUM_IDX * blocks * 4  # written by the scorer, read by the top-k
    io_bytes = 2 * batch * NUM_Q * HEAD_DIM * 2 + batch * NUM_IDX * HEAD_DIM * 2
    total = index_bytes + selected_bytes + score_bytes + io_bytes
    sets = max(1, min(16, -(-3 * L2_BYTES // total)))
    gen = torch.Generator(device="cuda").manual_seed(ctx + batch + 11)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    table = kv.table(batch, ctx)

    def new_step() -> MsaStep:
        q = torch.randn(batch, NUM_Q, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        iq = torch.randn(batch, NUM_IDX, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        scores = torch.empty(batch, NUM_IDX, blocks, device="cuda")
        ids = torch.empty(batch, NUM_IDX, TOPK, dtype=torch.int32, device="cuda")
        return MsaStep(q, iq, scores, ids, torch.empty_like(q))

    def call(step: MsaStep) -> Callable[[], object]:
        def run() -> None:
            index_topk(
                step.index_q, index_k, table, seq_lens, starts, positions, PAGE, TOPK, 1, 0,
                blocks, scores=step.scores, out=step.block_ids,
            )  # fmt: skip
            paged_attention(
                step.q, k_cache, v_cache, table, seq_lens, starts, positions, PAGE, SCALE,
                step.block_ids, 1, out=step.out,
            )  # fmt: skip

        return run

    steps = [new_step() for _ in range(sets)]
    row: dict[str, float | int | str] = {"context": ctx, "batch": batch, "kv_dtype": dtype}
    row["msa_graph_us"] = graph_us([call(st) for st in steps])
    row.update(bandwidth.floors(total))
    row["floor_fraction"] = row["floor_us"] / row["msa_graph_us"]
    row["read_floor_fraction"] = row["read_floor_us"] / row["msa_graph_us"]
    row["bytes"] = total
    row["sdpa_dense_bf16_us"] = dense_us
    row["speedup_vs_sdpa"] = dense_us / row["msa_graph_us"]
    return row


SWEEP = {
    "default": DEFAULT_CONFIG,
    "no_pdl": dataclasses.replace(DEFAULT_CONFIG, decode_pdl=False),
    "block_n128": dataclasses.replace(DEFAULT_CONFIG, decode_block_n=128),
    "stages3": dataclasses.replace(DEFAULT_CONFIG, decode_num_stages=3),
    "warps8": dataclasses.replace(DEFAULT_CONFIG, decode_num_warps=8),
    "per_sm1": dataclasses.replace(DEFAULT_CONFIG, programs_per_sm=1),
    "per_sm4": dataclasses.replace(DEFAULT_CONFIG, programs_per_sm=4),
    "per_sm8": dataclasses.replace(DEFAULT_CONFIG, programs_per_sm=8),
    # Fixed split counts: at batch 1 the per-SM target is capped by the 32 work units anyway.
    "splits4": dataclasses.replace(DEFAULT_CONFIG, num_splits=4),
    "splits8": dataclasses.replace(DEFAULT_CONFIG, num_splits=8),
    "splits16": dataclasses.replace(DEFAULT_CONFIG, num_splits=16),
}


def prefill_point(kv: Context, chunk: int, ctx: int, sparse: bool) -> dict[str, float | int]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    positions = torch.arange(ctx - chunk, ctx, device="cuda")
    q = torch.randn(chunk, NUM_Q, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    ids = selection(positions, gen) if sparse else None
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    table = kv.table(1, ctx)

    def call() -> None:
        paged_attention(
            q, kv.k, kv.v, table, seq_lens, starts, positions, PAGE, SCALE, ids, chunk, out=out
        )

    us = eager_us(call)
    keys = TOPK * PAGE if sparse else ctx - chunk / 2  # average allowed keys per query
    flops = 4 * chunk * NUM_Q * HEAD_DIM * keys
    return {"chunk": chunk, "context": ctx, "sparse": sparse, "us": us, "tflops": flops / us / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    bandwidth = Bandwidth(copy=copy_bandwidth(), read=read_bandwidth())
    launch = launch_us()
    print(
        f"device bandwidth: copy {bandwidth.copy / 1e12:.2f} TB/s (read + write), "
        f"read-only {bandwidth.read / 1e12:.2f} TB/s; "
        f"empty-kernel launch in a graph {launch:.2f} µs"
    )
    kv = Context(max(batches), max(contexts))

    rows = []
    print("\nsparse attention alone (bf16 KV, random selections); floors: copy bw / read bw")
    print(
        f"{'ctx':>7} {'B':>3} {'graph µs':>9} {'eager µs':>9} {'floor µs':>8} {'%floor':>6} "
        f"{'%read':>6} {'splits':>6} {'sdpa µs':>9} {'tri-dense µs':>12} {'×sdpa':>6} {'×tri':>6}"
    )
    for ctx in contexts:
        for batch in batches:
            r = decode_point(kv, batch, ctx, bandwidth)
            rows.append(r)
            print(
                f"{ctx:>7} {batch:>3} {r['sparse_graph_us']:>9.2f} {r['sparse_eager_us']:>9.2f} "
                f"{r['floor_us']:>8.2f} {100 * r['floor_fraction']:>5.1f}% "
                f"{100 * r['read_floor_fraction']:>5.1f}% {r['splits']:>6} "
                f"{r['sdpa_dense_us']:>9.1f} {r['triton_dense_us']:>12.1f} "
                f"{r['speedup_vs_sdpa']:>6.1f} {r['speedup_vs_triton_dense']:>6.1f}"
            )

    msa = []
    print("\nMSA decode step (index scores + top-k + sparse attention), vs bf16 dense SDPA")
    print(
        f"{'ctx':>7} {'B':>3} {'kv':>8} {'graph µs':>9} {'MB':>7} {'floor µs':>8} {'%floor':>6} "
        f"{'%read':>6} {'×sdpa':>6}"
    )
    for r0 in rows:
        for dtype in ("bf16", "fp8_e4m3"):
            r = msa_point(kv, r0["batch"], r0["context"], bandwidth, dtype, r0["sdpa_dense_us"])
            msa.append(r)
            print(
                f"{r['context']:>7} {r['batch']:>3} {dtype:>8} {r['msa_graph_us']:>9.2f} "
                f"{r['bytes'] / 1e6:>7.1f} {r['floor_us']:>8.2f} "
                f"{100 * r['floor_fraction']:>5.1f}% {100 * r['read_floor_fraction']:>5.1f}% "
                f"{r['speedup_vs_sdpa']:>6.1f}"
            )

    sweep = []
    if not args.no_sweep:
        ctx = max(contexts)
        print(f"\nsweep at {ctx} (sparse, graph µs / % of floor)")
        for name, cfg in SWEEP.items():
            cells = []
            for batch in batches:
                r = decode_point(kv, batch, ctx, bandwidth, cfg)
                sweep.append({"config": name, **dataclasses.asdict(cfg), **r})
                cells.append(
                    f"B={batch}: {r['sparse_graph_us']:7.2f} µs {100 * r['floor_fraction']:5.1f}% "
                    f"({r['splits']} splits)"
                )
            print(f"  {name:<11} " + "   ".join(cells))

    prefill = []
    if not args.no_prefill and max(contexts) >= 65536:
        print("\nprefill chunk (eager)")
        for sparse in (True, False):
            r = prefill_point(kv, 2048, 65536, sparse)
            prefill.append(r)
            kind = "sparse" if sparse else "dense"
            print(f"  2048 tokens at 64K {kind:<6}: {r['us']:9.1f} µs  {r['tflops']:6.1f} TFLOP/s")

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_bytes_per_s": bandwidth.copy,
        "read_bandwidth_bytes_per_s": bandwidth.read,
        "empty_kernel_launch_us": launch,
        "config": dataclasses.asdict(DEFAULT_CONFIG),
        "decode": rows,
        "msa_decode": msa,
        "sweep": sweep,
        "prefill": prefill,
    }
    write_result(result, "bench_sparse_attention.json", args.out)


if __name__ == "__main__":
    main()
