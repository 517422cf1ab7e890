"""The sampling kernels at B 1/8/64 over vocab 32768 and 200064: greedy and temperature 1 with
top_p 0.95 (and top_k 50). CUDA-graph replay, µs a call."""
import sys
import torch
sys.path.insert(0, "perf")
from gpu_timing import graph_us
from m3serve.kernels.triton.sampling import greedy, sample

dev = torch.device("cuda")
torch.manual_seed(0)
print(torch.cuda.get_device_name(), flush=True)
for vocab in (32768, 200064):
    for batch in (1, 8, 64):
        logits = torch.randn(batch, vocab, device=dev) * 3
        out = torch.empty(batch, dtype=torch.int64, device=dev)
        g = graph_us([lambda: greedy(logits, out)])
        cols = [f"greedy {g:6.1f}"]
        for name, k, p in (("top_p.95", 0, 0.95), ("top_k50", 50, 1.0), ("plain", 0, 1.0)):
            t = torch.ones(batch, device=dev)
            tk = torch.full((batch,), k, dtype=torch.int32, device=dev)
            tp = torch.full((batch,), p, device=dev)
            mp = torch.zeros(batch, device=dev)
            seeds = torch.arange(batch, device=dev)
            offs = torch.zeros(batch, dtype=torch.int64, device=dev)
            us = graph_us([lambda: sample(logits, t, tk, tp, mp, seeds, offs, out)])
            cols.append(f"{name} {us:6.1f}")
        print(f"vocab {vocab:6d} B{batch:3d}: " + "  ".join(cols), flush=True)
