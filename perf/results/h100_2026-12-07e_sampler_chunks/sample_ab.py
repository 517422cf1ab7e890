"""The sampler, one program a row (chunks=1) against rows spread over chunks (the default), and
the chunked path's tile/warps choices; same draws checked. CUDA-graph replay, µs a call."""
import sys
import torch
sys.path.insert(0, "perf")
from gpu_timing import graph_us
from m3serve.kernels.triton.sampling import sample

import inspect
BASE = "chunks" not in inspect.signature(sample).parameters
dev = torch.device("cuda")
print("baseline (HEAD)" if BASE else "this tree: chunks=1 -> default", flush=True)
print(torch.cuda.get_device_name(), flush=True)
MODES = {"greedy": (0.0, 0, 1.0), "top_p.95": (1.0, 0, 0.95), "top_k50": (1.0, 50, 1.0),
         "k50_p.95": (1.0, 50, 0.95), "plain": (1.0, 0, 1.0)}


def knobs(batch, t, k, p):
    return (torch.full((batch,), t, device=dev), torch.full((batch,), k, dtype=torch.int32, device=dev),
            torch.full((batch,), p, device=dev), torch.zeros(batch, device=dev),
            torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev))


def llm_like(batch, vocab, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(batch, vocab, device=dev, generator=g) * 2
    lead = torch.randint(0, vocab, (batch, 20), device=dev, generator=g)
    x.scatter_(1, lead, 12 + 4 * torch.rand(batch, 20, device=dev, generator=g))
    return x


for dist in ("flat", "llm"):
    for vocab in (32768, 200064):
        for batch in (1, 8, 64):
            logits = (torch.randn(batch, vocab, device=dev) * 3 if dist == "flat"
                      else llm_like(batch, vocab, 1))
            cols = []
            for name, (t, k, p) in MODES.items():
                kn = knobs(batch, t, k, p)
                out1 = torch.empty(batch, dtype=torch.int64, device=dev)
                out2 = torch.empty(batch, dtype=torch.int64, device=dev)
                if BASE:
                    one = graph_us([lambda: sample(logits, *kn, out1)])
                    auto = one
                    out2.copy_(out1)
                else:
                    one = graph_us([lambda: sample(logits, *kn, out1, chunks=1)])
                    auto = graph_us([lambda: sample(logits, *kn, out2)])
                same = torch.equal(out1, out2)
                cols.append(f"{name} {one:6.1f}->{auto:5.1f}{'' if same else '!'}")
            print(f"{dist:4s} V {vocab:6d} B{batch:3d}: " + "  ".join(cols), flush=True)

if BASE:
    sys.exit(0)
print("chunked tiles at B1 V 200064 (llm, flat), top_p .95:", flush=True)
for dist in ("llm", "flat"):
    logits = llm_like(1, 200064, 2) if dist == "llm" else torch.randn(1, 200064, device=dev) * 3
    kn = knobs(1, 1.0, 0, 0.95)
    row = []
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            for chunks in (16, 32, 64):
                us = graph_us([lambda: sample(logits, *kn, block=block, num_warps=warps, chunks=chunks)])
                row.append(f"b{block}w{warps}c{chunks} {us:5.1f}")
    print(dist, "  ".join(row), flush=True)
