"""Session 43: T = 1..8 W4A16 decode with K splits and register caps (more warps an SM) against
the plan's tiles, graph µs and % of the read bandwidth measured in the same run."""
import json, os, sys
sys.path.insert(0, "perf")
import torch
import bench_nvfp4_moe as b
from gpu_timing import graph_us
from m3serve.kernels.triton.nvfp4_moe import NVFP4MoEConfig

VARIANTS = {
    "plan": NVFP4MoEConfig(),
    "split2_k1": NVFP4MoEConfig(split_k=2, k_tiles=1),
    "split2_k1_r96": NVFP4MoEConfig(split_k=2, k_tiles=1, max_registers=96),
    "split2_k1_r80": NVFP4MoEConfig(split_k=2, k_tiles=1, max_registers=80),
}
ex = b.random_experts()
from gpu_timing import read_bandwidth
read_bw = read_bandwidth()
rows = []
for t in (1, 8):
    group = b.steps(t, b.SETS, seed=t)
    nbytes = sum(s.distinct() for s in group) / len(group) * ex.bytes_per_expert()
    ref = b.moe_call(ex, group[0])()
    line = f"T {t}:"
    for name, cfg in VARIANTS.items():
        try:
            out = b.moe_call(ex, group[0], cfg)()
            diff = (out.float() - ref.float()).abs().max().item()
            us = graph_us([b.moe_call(ex, s, cfg) for s in group])
        except Exception as exc:
            print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:200]}")
            continue
        frac = nbytes / (us * 1e-6) / read_bw
        rows.append({"tokens": t, "variant": name, "us": us, "read_fraction": frac, "max_abs_diff": diff})
        line += f"  {name} {us:6.1f} ({100 * frac:4.1f}%{'' if diff == 0 else f' d{diff:.0e}'})"
    print(line, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "read_bw": read_bw, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "t1_occ.json"), "w"), indent=1)
