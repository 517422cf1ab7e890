"""The indexer's block scores at decode: pages a program (served: at least 2) at batch 1 and 8,
contexts 1K-64K, index-K rotated past L2 (32 page sets)."""

import sys

import torch

sys.path.insert(0, "perf")
from gpu_timing import graph_us  # noqa: E402

from m3serve.kernels.triton.indexer import block_scores  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(0)
PAGE, SETS = 128, 32
for batch in (1, 8):
    for context in (1024, 4096, 16384, 65536):
        pages = -(-context // PAGE)
        if batch * pages * SETS * PAGE * 128 * 2 > 4e9:
            continue
        cache = torch.randn(batch * pages * SETS * PAGE, 128, device=dev).to(torch.bfloat16)
        q = torch.randn(batch, 4, 128, device=dev).to(torch.bfloat16)
        seq = torch.full((batch,), context, dtype=torch.int32, device=dev)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        pos = (seq - 1).to(torch.int64)
        tables = [
            (torch.arange(batch * pages, device=dev, dtype=torch.int32) + s * batch * pages).view(
                batch, pages
            )
            for s in range(SETS)
        ]
        line = f"batch {batch} context {context:6d} ({pages:4d} pages):"
        ref = block_scores(q, cache, tables[0], seq, starts, pos, PAGE, pages)
        for per in (None, 1, 2, 4):
            got = block_scores(
                q, cache, tables[0], seq, starts, pos, PAGE, pages, pages_per_program=per
            )
            same = torch.equal(got, ref)
            out = torch.empty_like(ref)
            us = graph_us(
                [
                    lambda t=t, p=per: block_scores(
                        q, cache, t, seq, starts, pos, PAGE, pages, out=out, pages_per_program=p
                    )
                    for t in tables
                ]
            )
            line += f"  {per or 'served'}: {us:5.2f}{'' if same else ' DIFFERS'}"
        print(line, flush=True)
        del cache
