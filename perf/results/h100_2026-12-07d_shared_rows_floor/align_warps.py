"""The sorted route's metadata kernels (align.py) at decode and mixed-step sizes, with 4 (served),
8 and 16 warps: their [128, E] one-hot tiles hold 128 int32 a thread per tile at 4 warps."""

import sys

import torch
import triton

sys.path.insert(0, "perf")
from gpu_timing import graph_us  # noqa: E402

from m3serve.kernels.triton.nvfp4_moe import align  # noqa: E402
from m3serve.kernels.triton.nvfp4_moe.plan import plan_moe  # noqa: E402

dev = torch.device("cuda")


def run(flat_ids, num_experts, block_m, tail_m, warps, chunk=128):
    num_pairs = flat_ids.numel()
    busy = min(num_experts, num_pairs)
    blocks = min(num_pairs, (num_pairs + busy * (block_m - 1)) // block_m)
    chunks = triton.cdiv(num_pairs, chunk)
    e_pad = triton.next_power_of_2(num_experts)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(blocks * (block_m + tail_m), dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    align._count_kernel[(chunks,)](
        flat_ids, num_pairs, num_experts, counts, CHUNK=chunk, E_PAD=e_pad, num_warps=warps[0]
    )
    align._place_kernel[(max(chunks, triton.cdiv(blocks * (block_m + tail_m), chunk)),)](
        flat_ids,
        num_pairs,
        num_experts,
        counts,
        chunks,
        sorted_pairs,
        block_expert,
        blocks,
        CHUNK=chunk,
        E_PAD=e_pad,
        ROWS=align._COUNT_ROWS,
        BLOCK_M=block_m,
        TAIL_M=tail_m,
        num_warps=warps[1],
    )
    return sorted_pairs, block_expert


for tokens, experts in ((64, 128), (128, 128), (360, 128), (1024, 128), (64, 8), (360, 8)):
    ids = torch.stack([torch.randperm(experts, device=dev)[:4] for _ in range(tokens)])
    flat = ids.flatten().to(torch.int32)
    p = plan_moe(tokens * 4, experts, "sorted")
    ref = align.align_pairs(flat, experts, p.block_m, p.tail_m)
    line = f"T {tokens:5d} E {experts:3d} block_m {p.block_m} tail {p.tail_m}:"
    for chunk, *warps in (
        (128, 4, 4),
        (128, 8, 8),
        (64, 4, 4),
        (64, 4, 8),
        (32, 4, 4),
        (32, 2, 4),
        (16, 2, 4),
    ):
        got = run(flat, experts, p.block_m, p.tail_m, warps, chunk)
        same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        us = graph_us([lambda w=warps, c=chunk: run(flat, experts, p.block_m, p.tail_m, w, c)])
        line += f"  c{chunk} w{warps[0]}/{warps[1]} {us:5.1f}{'' if same else ' DIFFERS'}"
    print(line, flush=True)
