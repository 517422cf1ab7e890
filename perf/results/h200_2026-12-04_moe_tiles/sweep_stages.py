"""Scratch: NVFP4 MoE decode vs pipeline depth / tiles at small T (H200)."""
import sys, time
sys.path.insert(0, "perf")
import torch
from bench_nvfp4_moe import random_experts, steps, moe_call, SETS
from gpu_timing import graph_us, read_bandwidth
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig

C = NVFP4MoEConfig
CONFIGS = {
    "default": C(),
    "n64": C(block_n=64, k_tiles=1), "n64k2": C(block_n=64, k_tiles=2),
    "n128": C(block_n=128, k_tiles=1), "n128k2": C(block_n=128, k_tiles=2),
    "n128s4": C(block_n=128, k_tiles=1, num_stages=4),
}
read_bw = read_bandwidth()
ex = random_experts()
print(f"read bw {read_bw/1e12:.2f} TB/s", flush=True)
tokens = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 32, 64]
table = {}
for t in tokens:
    group = steps(t, SETS, seed=t)
    nbytes = sum(s.distinct() for s in group) / len(group) * ex.bytes_per_expert()
    ref = moe_call(ex, group[0])().float()
    for name, cfg in CONFIGS.items():
        t0 = time.time()
        try:
            out = moe_call(ex, group[0], cfg)().float()
            diff = ((out - ref).norm() / ref.norm()).item()
            us = graph_us([moe_call(ex, s, cfg) for s in group])
        except Exception as e:  # noqa: BLE001
            print(f"T={t} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        frac = nbytes / (us * 1e-6) / read_bw
        table[(t, name)] = (us, frac)
        print(f"T={t:3d} {name:>9}: {us:8.1f} µs {100*frac:5.1f}% diff {diff:.1e} ({time.time()-t0:.0f} s)", flush=True)
