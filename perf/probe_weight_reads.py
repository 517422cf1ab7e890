"""Read-only probe of the NVFP4 experts' access pattern on the GPU: the same bytes read by the same
grid, either row-major (the checkpoint's layout: a K step reads BLOCK_KB bytes of each of
BLOCK_N rows, each a row apart) or tile-contiguous (each K step's BLOCK_N x BLOCK_KB bytes one
run), as a fraction of the device's read bandwidth measured in the same run.

The volumes are the MoE's: one expert's gate_up (6144 rows x 3072 bytes) times E experts, E = 4
(batch 1 at top-4) and 32. This is what `m3serve.kernels.nvfp4_tiles` was chosen from.

    python perf/probe_weight_reads.py [--experts 4 32] [--out PATH]

Prints a table; writes JSON to $OUT/probe_weight_reads.json when $OUT is set, else to
perf/results/probe_weight_reads.json (or --out).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_timing import graph_us, read_bandwidth
from result_json import write_result

ROWS, ROW_BYTES = 6144, 3072  # one expert's gate_up at M3.1's widths
TILES = [(64, 32), (64, 64), (64, 128), (64, 256), (128, 32), (128, 64), (128, 128)]


@triton.jit
def _rows_kernel(
    w_ptr, out_ptr, stride_e, stride_n, KB, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_KB)
    p = w_ptr + tl.program_id(1).to(tl.int64) * stride_e + rn[:, None] * stride_n + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_KB], dtype=tl.int32)
    for k0 in range(0, KB, BLOCK_KB):
        acc += tl.load(p + k0).to(tl.int32)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _tiles_kernel(w_ptr, out_ptr, stride_e, KB, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    TILE: tl.constexpr = BLOCK_N * BLOCK_KB
    e = tl.program_id(1).to(tl.int64)
    base = w_ptr + e * stride_e + tl.program_id(0).to(tl.int64) * BLOCK_N * KB
    r = tl.arange(0, TILE)
    acc = tl.zeros([TILE], dtype=tl.int32)
    for k0 in range(0, KB, BLOCK_KB):
        acc += tl.load(base + k0 * BLOCK_N + r).to(tl.int32)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def probe(experts: int, read_bw: float) -> list[dict[str, float | int]]:
    # Three weight sets rotated through, so that the 4-expert volume is not found in L2.
    sets = [
        torch.randint(0, 256, (experts, ROWS, ROW_BYTES), dtype=torch.uint8, device="cuda")
        for _ in range(3 if experts <= 8 else 1)
    ]
    nbytes = experts * ROWS * ROW_BYTES
    rows = []
    for bn, bkb in TILES:
        us_rows = graph_us([_call(w, bn, bkb, tiled=False) for w in sets])
        us_tiles = graph_us([_call(w, bn, bkb, tiled=True) for w in sets])
        rows.append(
            {
                "experts": experts,
                "block_n": bn,
                "block_kb": bkb,
                "rows_us": us_rows,
                "tiles_us": us_tiles,
                "rows_fraction": nbytes / (us_rows * 1e-6) / read_bw,
                "tiles_fraction": nbytes / (us_tiles * 1e-6) / read_bw,
            }
        )
    return rows


def _call(w: torch.Tensor, bn: int, bkb: int, tiled: bool) -> Callable[[], object]:
    """One read of all of w, BLOCK_N rows x BLOCK_KB bytes a K step, one program per row tile
    and expert."""
    experts = w.shape[0]
    out = torch.empty(experts * (ROWS // bn), dtype=torch.int32, device="cuda")
    grid = (ROWS // bn, experts)
    common = {"BLOCK_N": bn, "BLOCK_KB": bkb, "num_warps": 4}
    if tiled:
        return lambda: _tiles_kernel[grid](w, out, w.stride(0), ROW_BYTES, **common)
    return lambda: _rows_kernel[grid](w, out, w.stride(0), w.stride(1), ROW_BYTES, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    read_bw = read_bandwidth()
    print(f"device read-only bandwidth {read_bw / 1e12:.2f} TB/s")
    head = ("E", "rows", "bytes/row", "row-major µs", "%bw", "tiles µs", "%bw")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (3, 5, 9, 12, 6, 9, 6), strict=True)))
    rows = []
    for e in args.experts:
        for r in probe(e, read_bw):
            rows.append(r)
            print(
                f"{e:>3} {r['block_n']:>5} {r['block_kb']:>9} {r['rows_us']:>12.1f} "
                f"{100 * r['rows_fraction']:>5.1f}% {r['tiles_us']:>9.1f} "
                f"{100 * r['tiles_fraction']:>5.1f}%"
            )
    result = {"device": torch.cuda.get_device_name(), "read_bandwidth_bytes_per_s": read_bw}
    result["rows"] = rows
    write_result(result, "probe_weight_reads.json", args.out)


if __name__ == "__main__":
    main()
