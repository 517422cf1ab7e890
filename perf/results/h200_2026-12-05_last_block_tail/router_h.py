"""The router's GEMV route at T 1-8: hidden step 1024 (served) against the whole row at once."""
import torch
from bench_router import cold_sets, kernel_calls, make_sets, same_experts
from gpu_timing import graph_us

from m3serve.kernels.triton import router

for tokens in (1, 2, 4, 8):
    sets = make_sets(tokens, cold_sets(tokens), seed=tokens)
    cells = []
    for max_h in (1024, 2048, 8192):
        router._GEMV_MAX_H = max_h
        ok = same_experts(sets[0])
        cold = graph_us(kernel_calls(sets))
        hot = graph_us(kernel_calls(sets[:1]))
        cells.append(f"H{max_h} {cold:5.1f}/{hot:5.1f} ({ok:.2f})")
    print(f"T {tokens}: " + "  ".join(cells), flush=True)
router._GEMV_MAX_H = 1024
