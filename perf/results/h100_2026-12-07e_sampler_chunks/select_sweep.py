"""Block top-k (select_blocks) at decode shapes: radix bits x warps, rows 4/32/256 (batch 1/8/64
with 4 index heads), blocks 32/128/512/1024. CUDA-graph replay, µs a call."""
import sys
import torch
sys.path.insert(0, "perf")
from gpu_timing import graph_us
from m3serve.kernels.triton.indexer import select_blocks

dev = torch.device("cuda")
torch.manual_seed(0)
H, PAGE, TOPK = 4, 128, 16
print(torch.cuda.get_device_name(), flush=True)
for batch in (1, 8, 64):
    for blocks in (32, 128, 512, 1024):
        scores = torch.randn(batch, H, blocks, device=dev)
        pos = torch.full((batch,), blocks * PAGE - 1, dtype=torch.int64, device=dev)
        ref = select_blocks(scores, pos, PAGE, TOPK, 1)
        row = []
        for radix in (2, 4, 8):
            for warps in (None, 1, 2, 4):
                if radix == 8 and blocks > 256:
                    continue
                out = torch.empty_like(ref)
                fn = lambda r=radix, w=warps, o=out: select_blocks(  # noqa: E731
                    scores, pos, PAGE, TOPK, 1, out=o, radix_bits=r, num_warps=w)
                fn()
                same = torch.equal(out, ref)
                us = graph_us([fn])
                row.append(f"r{radix}w{warps or 'd'} {us:5.2f}{'' if same else '!'}")
        print(f"B{batch:3d} blocks {blocks:5d}: " + "  ".join(row), flush=True)
