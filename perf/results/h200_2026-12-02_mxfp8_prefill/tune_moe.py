"""Tile sweep of the NVFP4 MoE sorted route at E 8 and 128, prefill sizes (graph-replay µs)."""
import json, os, sys, time
sys.path.insert(0, "perf")
import bench_nvfp4_moe as b
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig
from m3serve.kernels.triton.nvfp4_moe.plan import plan_moe

CONFIGS = {
    "default": NVFP4MoEConfig(route="sorted"),
    "m128n128w8s3k128": NVFP4MoEConfig(route="sorted", block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128),
    "m128n128w8s4k64": NVFP4MoEConfig(route="sorted", block_m=128, block_n=128, num_warps=8, num_stages=4, block_k=64),
    "m128n256w8s3k64": NVFP4MoEConfig(route="sorted", block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64),
    "m64n128w4s4k128": NVFP4MoEConfig(route="sorted", block_m=64, block_n=128, num_warps=4, num_stages=4, block_k=128),
    "m64n128w8s3k128": NVFP4MoEConfig(route="sorted", block_m=64, block_n=128, num_warps=8, num_stages=3, block_k=128),
    "m128n64w4s3k128": NVFP4MoEConfig(route="sorted", block_m=128, block_n=64, num_warps=4, num_stages=3, block_k=128),
    "m256n128w8s3k64": NVFP4MoEConfig(route="sorted", block_m=256, block_n=128, num_warps=8, num_stages=3, block_k=64),
    "m128n128w4s3k128": NVFP4MoEConfig(route="sorted", block_m=128, block_n=128, num_warps=4, num_stages=3, block_k=128),
    "m64n64w4s4k256": NVFP4MoEConfig(route="sorted", block_m=64, block_n=64, num_warps=4, num_stages=4, block_k=256),
    "m128n128w8s2k128": NVFP4MoEConfig(route="sorted", block_m=128, block_n=128, num_warps=8, num_stages=2, block_k=128),
    "m64n256w8s3k64": NVFP4MoEConfig(route="sorted", block_m=64, block_n=256, num_warps=8, num_stages=3, block_k=64),
}
rows = []
t0 = time.time()
for e in (8, 128):
    b.E = e
    ex = b.random_experts()
    for t in (128, 512, 2048):
        flops = 2.0 * t * b.TOP_K * 3 * b.INTER * b.H
        group = b.steps(t, 2, seed=t)
        p = plan_moe(t * b.TOP_K, e, b.H, b.INTER, "sorted")
        for name, cfg in CONFIGS.items():
            try:
                us = graph_us([b.moe_call(ex, s, cfg) for s in group], budget_ms=60.0)
            except Exception as err:  # noqa: BLE001
                print(f"E {e} T {t} {name}: failed {type(err).__name__}: {str(err)[:100]}", flush=True)
                continue
            rows.append({"E": e, "T": t, "variant": name, "us": us, "tflops": flops / us / 1e6})
            print(f"E {e:3d} T {t:5d} {name:18s} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s"
                  + (f"  (plan m{p.block_m} n{p.gate_up_n} w{p.num_warps} s{p.num_stages} k{p.block_k_h})" if name == "default" else ""),
                  flush=True)
        if time.time() - t0 > 200:
            break
    del ex
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/tune_moe.json", "w"), indent=1)
