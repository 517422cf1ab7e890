"""Session 42: W4A16 MoE prefill with 256 weight rows a program (one program an SM sharing its
activation tile across four warpgroups) against the plan's tiles, E 128 and E 8, graph µs."""
import json, os, sys
sys.path.insert(0, "perf")
import torch
import bench_nvfp4_moe as b
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig
from m3serve.kernels.triton.nvfp4_moe.plan import plan_moe

VARIANTS = {
    "plan": NVFP4MoEConfig(),
    "n256_w16": NVFP4MoEConfig(block_n=256, num_warps=16, max_registers=0),
}
rows = []
for experts, sizes in ((128, [2048, 4096]), (8, [272])):
    b.E = experts
    ex = b.random_experts()
    for t in sizes:
        group = b.steps(t, 2, seed=t)
        flops = 2.0 * t * b.TOP_K * (2 * b.INTER * b.H + b.H * b.INTER)
        p = plan_moe(t * b.TOP_K, experts, "auto")
        ref = b.moe_call(ex, group[0])()
        line = f"E {experts:3d} T {t:5d} bm {p.block_m:3d} tail {p.tail_m:2d} n {p.gate_up_n} w {p.num_warps}:"
        for name, cfg in VARIANTS.items():
            try:
                out = b.moe_call(ex, group[0], cfg)()
                diff = (out.float() - ref.float()).abs().max().item()
                us = graph_us([b.moe_call(ex, s, cfg) for s in group], budget_ms=60.0)
            except Exception as exc:
                print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:300]}")
                continue
            rows.append({"experts": experts, "tokens": t, "variant": name, "us": us,
                         "tflops": flops / us / 1e6, "max_abs_diff": diff})
            line += f"  {name} {us:8.1f} ({flops / us / 1e6:5.0f} TF{'' if diff == 0 else f', diff {diff:.1e}'})"
        if experts == 128 and t == 2048:
            dense = b.dense_bf16_us(t * b.TOP_K)
            line += f"  dense {dense:8.1f} ({flops / dense / 1e6:5.0f} TF)"
            rows.append({"experts": experts, "tokens": t, "variant": "dense_bf16", "us": dense,
                         "tflops": flops / dense / 1e6})
        print(line, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "wide_tiles.json"), "w"), indent=1)
