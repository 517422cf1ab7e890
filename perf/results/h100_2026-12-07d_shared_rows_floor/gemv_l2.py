"""The MXFP8 GEMV's own ceiling: M = 1 from an L2-resident weight (the kernel, not HBM, sets
the time) and from HBM (copies rotated past L2), for GEMV plans around the served one."""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, "perf")
from gpu_timing import graph_us, read_bandwidth

from m3serve.kernels.triton.mxfp8_linear import Mxfp8Plan, mxfp8_linear

dev = torch.device("cuda")
torch.manual_seed(0)


def weight(n, k):
    codes = (torch.randn(n, k, device=dev) * 16).to(torch.float8_e4m3fn)
    scales = torch.randint(118, 124, (n, k // 32), device=dev, dtype=torch.uint8)
    return codes, scales


plans = [None]
for bn, bk, w, s in itertools.product((4, 8), (1024, 2048), (4, 8), (2, 3, 4)):
    plans.append(Mxfp8Plan(1, bn, bk, 1, w, s, gemv=True))
plans += [
    Mxfp8Plan(1, 2, 2048, 1, 4, 3, gemv=True),
    Mxfp8Plan(1, 16, 512, 1, 8, 3, gemv=True),
    Mxfp8Plan(1, 2, 1024, 1, 2, 3, gemv=True),
    Mxfp8Plan(1, 4, 512, 1, 2, 4, gemv=True),
]
x = torch.randn(1, 6144, device=dev).to(torch.bfloat16)
small = [weight(2048, 6144)]  # 12.6 MB: stays in L2
big = [weight(6144, 6144) for _ in range(6)]  # 6 x 37.7 MB rotated: read from HBM
bw = read_bandwidth()
print(f"read bandwidth {bw / 1e12:.2f} TB/s")
rows = []
ref = mxfp8_linear(x, *small[0])
for p in plans:
    try:
        y = mxfp8_linear(x, *small[0], plan=p)
        err = float((y.float() - ref.float()).abs().max())
        out = torch.empty(1, 2048, device=dev, dtype=torch.bfloat16)
        l2 = graph_us([lambda c=c, s=s: mxfp8_linear(x, c, s, out, plan=p) for c, s in small])
        out = torch.empty(1, 6144, device=dev, dtype=torch.bfloat16)
        hbm = graph_us([lambda c=c, s=s: mxfp8_linear(x, c, s, out, plan=p) for c, s in big])
    except Exception as e:
        print(p, "failed", type(e).__name__, str(e)[:100])
        continue
    b_small = 2048 * 6144 * (1 + 1 / 32)
    b_big = 6144 * 6144 * (1 + 1 / 32)
    name = "served" if p is None else f"n{p.block_n} k{p.block_k} w{p.num_warps} s{p.num_stages}"
    r = {
        "plan": name,
        "l2_us": l2,
        "l2_tbs": b_small / l2 / 1e6,
        "hbm_us": hbm,
        "hbm_tbs": b_big / hbm / 1e6,
        "max_abs_diff": err,
    }
    rows.append(r)
    print(
        f"{name:>20} L2 {l2:7.2f} us {r['l2_tbs']:5.2f} TB/s  HBM {hbm:7.2f} us "
        f"{r['hbm_tbs']:5.2f} TB/s  diff {err:.1e}",
        flush=True,
    )
out_dir = os.environ.get("OUT", ".")
json.dump({"read_bandwidth": bw, "rows": rows}, open(f"{out_dir}/gemv_l2.json", "w"), indent=1)
